//! Hybrid models: a stack whose layers attend differently (Gemma 2 and 3,
//! gpt-oss, Mistral's all-window stack) keeps one block table per group
//! of layers that attend alike, so that a sliding-window group holds only
//! the blocks its window can still read while the full-attention group
//! holds the whole sequence.
//!
//! [`LayerGroups`] declares the groups (every layer in exactly one) and
//! their [`GroupKind`]. [`HybridManager`] keeps one [`BlockManager`] per
//! group, each over its own pool: a group's block ids index that group's
//! KV pool (`KvCache` with the group's layers), so the engine runs layer
//! `l` on the pool and the tables of its group (`LayerGroups::group_of`).
//! A call either succeeds in every group or changes none.
//!
//! After each step's view, a window group releases the blocks wholly
//! behind its window ([`BlockManager::release_outside_window`]); their
//! table entries become [`RELEASED`](super::RELEASED), which the kernels
//! skip, and a released block whose content is cached stays in that
//! group's prefix cache until evicted. Admission still takes a prompt's
//! blocks in every group (its prefill writes every position); the window
//! groups give theirs back at the end of the prefill step.

use super::{BatchView, BlockError, BlockManager, BlockManagerConfig, BlockStats, SeqId};

/// How a group of layers attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// Every position: the group keeps every block.
    Full,
    /// The last `window` positions (the newest included): the group keeps
    /// the blocks that hold them.
    Window(u32),
    /// The first `sinks` positions beside a window of `window` (StreamingLLM):
    /// the group keeps the sinks' blocks and the window's.
    SinksAndWindow {
        /// Leading positions always visible.
        sinks: u32,
        /// The window.
        window: u32,
    },
}

/// Layers that share one block table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGroup {
    /// How they attend.
    pub kind: GroupKind,
    /// The layers, in the order the group's pool holds them.
    pub layers: Vec<u32>,
}

/// Why a group declaration was refused. Nothing was made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// No layers, or no groups.
    #[error("a stack of {layers} layers in {groups} groups: both must be positive")]
    Empty {
        /// Layers declared.
        layers: u32,
        /// Groups declared.
        groups: usize,
    },
    /// A group without a layer.
    #[error("group {0} has no layer")]
    EmptyGroup(usize),
    /// A layer past the stack.
    #[error("group {group} names layer {layer}; the stack has {layers}")]
    LayerOutOfRange {
        /// The group.
        group: usize,
        /// The layer.
        layer: u32,
        /// Layers in the stack.
        layers: u32,
    },
    /// A layer in two groups (or twice in one).
    #[error("layer {0} is in more than one group")]
    Twice(u32),
    /// A layer in no group.
    #[error("layer {0} is in no group")]
    Uncovered(u32),
    /// A window of 0 positions.
    #[error("group {0} has a window of 0 positions")]
    ZeroWindow(usize),
    /// An interleaving period of 0.
    #[error("one full-attention layer every {0} layers: the period must be positive")]
    ZeroPeriod(u32),
    /// Pools given for a number of groups other than the layout's.
    #[error("{given} pool sizes for {groups} groups")]
    PoolCount {
        /// Sizes given.
        given: usize,
        /// Groups in the layout.
        groups: usize,
    },
}

/// A model's layers in groups, every layer in exactly one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGroups {
    num_layers: u32,
    groups: Vec<LayerGroup>,
    /// Per layer: (group, index within the group).
    of_layer: Vec<(usize, usize)>,
}

impl LayerGroups {
    /// Checks that `groups` cover layers `0..num_layers` exactly once, each
    /// group non-empty, no window of 0.
    pub fn new(num_layers: u32, groups: Vec<LayerGroup>) -> Result<Self, GroupError> {
        if num_layers == 0 || groups.is_empty() {
            return Err(GroupError::Empty {
                layers: num_layers,
                groups: groups.len(),
            });
        }
        let mut of_layer = vec![None; num_layers as usize];
        for (g, group) in groups.iter().enumerate() {
            if group.layers.is_empty() {
                return Err(GroupError::EmptyGroup(g));
            }
            match group.kind {
                GroupKind::Window(0) | GroupKind::SinksAndWindow { window: 0, .. } => {
                    return Err(GroupError::ZeroWindow(g));
                }
                _ => {}
            }
            for (i, &l) in group.layers.iter().enumerate() {
                let slot = of_layer
                    .get_mut(l as usize)
                    .ok_or(GroupError::LayerOutOfRange {
                        group: g,
                        layer: l,
                        layers: num_layers,
                    })?;
                if slot.is_some() {
                    return Err(GroupError::Twice(l));
                }
                *slot = Some((g, i));
            }
        }
        let of_layer = of_layer
            .iter()
            .enumerate()
            .map(|(l, s)| s.ok_or(GroupError::Uncovered(l as u32)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            num_layers,
            groups,
            of_layer,
        })
    }

    /// Every layer in one group of `kind` (Mistral-7B v0.1: a window of
    /// 4096 everywhere; a dense model: full).
    pub fn uniform(num_layers: u32, kind: GroupKind) -> Result<Self, GroupError> {
        Self::new(
            num_layers,
            vec![LayerGroup {
                kind,
                layers: (0..num_layers).collect(),
            }],
        )
    }

    /// One full-attention layer every `period` layers (the last of each
    /// period: layers `period - 1`, `2 * period - 1`, ...), the others in
    /// a window group of `local`: Gemma 3 (`period` 6), Gemma 2 and gpt-oss
    /// (`period` 2). Two groups (one when every layer is full).
    pub fn interleaved(num_layers: u32, period: u32, local: GroupKind) -> Result<Self, GroupError> {
        if period == 0 {
            return Err(GroupError::ZeroPeriod(period));
        }
        let (full, windowed): (Vec<u32>, Vec<u32>) =
            (0..num_layers).partition(|l| (l + 1) % period == 0);
        let mut groups = Vec::new();
        if !windowed.is_empty() {
            groups.push(LayerGroup {
                kind: local,
                layers: windowed,
            });
        }
        if !full.is_empty() {
            groups.push(LayerGroup {
                kind: GroupKind::Full,
                layers: full,
            });
        }
        Self::new(num_layers, groups)
    }

    /// Layers in the stack.
    pub fn num_layers(&self) -> u32 {
        self.num_layers
    }

    /// The groups.
    pub fn groups(&self) -> &[LayerGroup] {
        &self.groups
    }

    /// Layer `layer`'s group and its index in the group's pool; `None` past
    /// the stack.
    pub fn group_of(&self, layer: u32) -> Option<(usize, usize)> {
        self.of_layer.get(layer as usize).copied()
    }

    /// Blocks of `block_size` tokens one sequence of `tokens` keeps per
    /// group once its window groups released what they cannot read (the
    /// steady state after a step).
    pub fn blocks_kept(&self, tokens: u64, block_size: u32) -> Vec<u64> {
        let bs = block_size.max(1) as u64;
        let all = tokens.div_ceil(bs);
        self.groups
            .iter()
            .map(|g| match g.kind {
                GroupKind::Full => all,
                GroupKind::Window(w) => all - first_kept(tokens, w as u64, bs),
                GroupKind::SinksAndWindow { sinks, window } => {
                    let sink_blocks = (sinks as u64).div_ceil(bs).min(all);
                    let first = first_kept(tokens, window as u64, bs).max(sink_blocks);
                    sink_blocks + (all - first)
                }
            })
            .collect()
    }

    /// Layer-blocks (blocks times the group's layers) one sequence of
    /// `tokens` keeps, against full retention (every layer every block).
    pub fn layer_blocks(&self, tokens: u64, block_size: u32) -> (u64, u64) {
        let kept: u64 = self
            .blocks_kept(tokens, block_size)
            .iter()
            .zip(&self.groups)
            .map(|(b, g)| b * g.layers.len() as u64)
            .sum();
        let full = tokens.div_ceil(block_size.max(1) as u64) * self.num_layers as u64;
        (kept, full)
    }
}

/// The first block a window of `w` positions still reads in a sequence of
/// `tokens` (its newest at `tokens - 1`).
fn first_kept(tokens: u64, w: u64, bs: u64) -> u64 {
    (tokens.saturating_sub(w)) / bs
}

/// Handle of a sequence in a [`HybridManager`]: its id in each group's
/// manager.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HybridSeq(Vec<SeqId>);

impl HybridSeq {
    /// Its id in group `g`'s manager.
    pub fn in_group(&self, g: usize) -> Option<SeqId> {
        self.0.get(g).copied()
    }
}

/// Why a [`HybridManager`] call was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HybridError {
    /// The layout.
    #[error(transparent)]
    Groups(#[from] GroupError),
    /// Group `group`'s manager refused the call.
    #[error("layer group {group}: {source}")]
    Block {
        /// The group.
        group: usize,
        /// Its manager's error.
        source: BlockError,
    },
    /// A handle of another manager, or of a freed sequence.
    #[error("this sequence is not one of this manager's live sequences")]
    UnknownSequence,
}

/// One [`BlockManager`] per layer group, each over its own pool, kept in
/// step: the same sequences, forks and tokens in every group; the window
/// groups release what their windows no longer read.
pub struct HybridManager {
    groups: LayerGroups,
    managers: Vec<BlockManager>,
}

impl HybridManager {
    /// A manager per group of `groups`, group `g` over a pool of
    /// `blocks[g]` blocks of `block_size` tokens; `prefix_caching` in every
    /// group (a group's cache holds that group's blocks).
    pub fn new(
        groups: LayerGroups,
        blocks: &[u32],
        block_size: u32,
        prefix_caching: bool,
    ) -> Result<Self, HybridError> {
        if blocks.len() != groups.groups().len() {
            return Err(GroupError::PoolCount {
                given: blocks.len(),
                groups: groups.groups().len(),
            }
            .into());
        }
        let managers = blocks
            .iter()
            .enumerate()
            .map(|(g, &n)| {
                BlockManager::new(
                    BlockManagerConfig::new(n, block_size).with_prefix_caching(prefix_caching),
                )
                .map_err(|source| HybridError::Block { group: g, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { groups, managers })
    }

    /// The layout.
    pub fn groups(&self) -> &LayerGroups {
        &self.groups
    }

    /// Group `g`'s manager (its tables, stats and prefix cache).
    pub fn manager(&self, g: usize) -> Option<&BlockManager> {
        self.managers.get(g)
    }

    fn ids(&self, s: &HybridSeq) -> Result<(), HybridError> {
        if s.0.len() != self.managers.len()
            || s.0
                .iter()
                .zip(&self.managers)
                .any(|(&id, m)| !m.contains(id))
        {
            return Err(HybridError::UnknownSequence);
        }
        Ok(())
    }

    /// Fails with the first group that lacks `need(g)` blocks.
    fn room(
        &self,
        need: impl Fn(usize, &BlockManager) -> Result<usize, BlockError>,
    ) -> Result<(), HybridError> {
        for (g, m) in self.managers.iter().enumerate() {
            let needed = need(g, m).map_err(|source| HybridError::Block { group: g, source })?;
            if needed > m.available_blocks() {
                return Err(HybridError::Block {
                    group: g,
                    source: BlockError::OutOfBlocks {
                        needed,
                        free: m.available_blocks(),
                    },
                });
            }
        }
        Ok(())
    }

    /// Adds a sequence holding `prompt` in every group (sharing cached
    /// prefix blocks per group), or in none.
    pub fn add_sequence(&mut self, prompt: &[u32]) -> Result<HybridSeq, HybridError> {
        self.room(|_, m| Ok(m.blocks_to_add(prompt, &[])))?;
        let mut ids = Vec::with_capacity(self.managers.len());
        for (g, m) in self.managers.iter_mut().enumerate() {
            match m.add_sequence(prompt) {
                Ok(id) => ids.push(id),
                Err(source) => {
                    // Not reached once `room` passed; undone all the same.
                    for (h, &id) in ids.iter().enumerate() {
                        let _ = self.managers_undo(h, id);
                    }
                    return Err(HybridError::Block { group: g, source });
                }
            }
        }
        Ok(HybridSeq(ids))
    }

    fn managers_undo(&mut self, g: usize, id: SeqId) -> Result<(), BlockError> {
        self.managers[g].free(id)
    }

    /// Appends `tokens` to the sequence in every group; the new tokens'
    /// slots per group. Refused in every group when one lacks the blocks.
    pub fn append(&mut self, s: &HybridSeq, tokens: &[u32]) -> Result<Vec<Vec<u32>>, HybridError> {
        self.ids(s)?;
        self.room(|g, m| m.blocks_needed_to_append(&[s.0[g]], tokens.len()))?;
        let mut slots = Vec::with_capacity(self.managers.len());
        for (g, m) in self.managers.iter_mut().enumerate() {
            slots.push(
                m.append(s.0[g], tokens)
                    .map_err(|source| HybridError::Block { group: g, source })?,
            );
        }
        Ok(slots)
    }

    /// A fork of the sequence (parallel samples, beams) sharing its blocks
    /// in every group.
    pub fn fork(&mut self, s: &HybridSeq) -> Result<HybridSeq, HybridError> {
        self.ids(s)?;
        // A fork takes no block: only a copy-on-write later does.
        let mut ids = Vec::with_capacity(self.managers.len());
        for (g, m) in self.managers.iter_mut().enumerate() {
            ids.push(
                m.fork(s.0[g])
                    .map_err(|source| HybridError::Block { group: g, source })?,
            );
        }
        Ok(HybridSeq(ids))
    }

    /// Frees the sequence in every group.
    pub fn free(&mut self, s: &HybridSeq) -> Result<(), HybridError> {
        self.ids(s)?;
        for (g, m) in self.managers.iter_mut().enumerate() {
            m.free(s.0[g])
                .map_err(|source| HybridError::Block { group: g, source })?;
        }
        Ok(())
    }

    /// The step's view per group (tables, slots and copy-on-write pairs in
    /// that group's pool), then each window group releases, for every
    /// sequence, the blocks its window no longer reads. Record the step
    /// from these views before the next call takes a block: a released
    /// block may be handed out again.
    pub fn batch_view(&mut self, seqs: &[HybridSeq]) -> Result<Vec<BatchView>, HybridError> {
        for s in seqs {
            self.ids(s)?;
        }
        let mut views = Vec::with_capacity(self.managers.len());
        for (g, m) in self.managers.iter_mut().enumerate() {
            let ids: Vec<SeqId> = seqs.iter().map(|s| s.0[g]).collect();
            views.push(
                m.batch_view(&ids)
                    .map_err(|source| HybridError::Block { group: g, source })?,
            );
            let kind = self.groups.groups[g].kind;
            for &id in &ids {
                let r = match kind {
                    GroupKind::Full => Ok(0),
                    GroupKind::Window(w) => m.release_outside_window(id, w as usize),
                    GroupKind::SinksAndWindow { sinks, window } => {
                        m.release_outside_sinks_and_window(id, sinks as usize, window as usize)
                    }
                };
                r.map_err(|source| HybridError::Block { group: g, source })?;
            }
        }
        Ok(views)
    }

    /// Blocks the sequence's table holds per group (released entries not
    /// counted).
    pub fn blocks_held(&self, s: &HybridSeq) -> Result<Vec<usize>, HybridError> {
        self.ids(s)?;
        Ok(self
            .managers
            .iter()
            .zip(&s.0)
            .map(|(m, &id)| {
                m.block_table(id)
                    .map_or(0, |t| t.iter().filter(|&&b| b != super::RELEASED).count())
            })
            .collect())
    }

    /// Each group's pool statistics.
    pub fn stats(&self) -> Vec<BlockStats> {
        self.managers.iter().map(|m| m.stats()).collect()
    }
}
