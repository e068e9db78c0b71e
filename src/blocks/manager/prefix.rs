//! Prefix caching: chain digests, salted and remote prefixes, pinning, events and eviction.

use super::*;

impl BlockManager {
    /// [`add_sequence`](Self::add_sequence) in a prefix-cache namespace:
    /// blocks are shared only between prompts with the same `cache_salt`
    /// (and equal tokens). An engine gives each tenant, or each LoRA
    /// adapter, its own salt so that equal prompts of different tenants
    /// never share KV. The empty salt is the namespace of `add_sequence`.
    /// Forks inherit their parent's namespace.
    pub fn add_sequence_salted(
        &mut self,
        prompt: &[u32],
        cache_salt: &[u8],
    ) -> Result<SeqId, BlockError> {
        self.add_sequence_with_remote(prompt, cache_salt, 0)
            .map(|(id, _)| id)
    }

    /// The chain digests of `prompt`'s full blocks in `cache_salt`'s
    /// namespace, in order: the keys to ask a remote prefix store for (one
    /// tenant's salt never yields another's digests).
    pub fn prompt_hashes(&self, prompt: &[u32], cache_salt: &[u8]) -> Vec<[u8; 32]> {
        let mut h = chain_root(cache_salt);
        prompt
            .chunks_exact(self.cfg.block_size as usize)
            .map(|chunk| {
                h = chain_hash(&h, chunk);
                h
            })
            .collect()
    }

    /// [`add_sequence_salted`](Self::add_sequence_salted), with the
    /// prompt's first `remote` full blocks held by a remote prefix store
    /// (the leading digests of [`prompt_hashes`](Self::prompt_hashes) it
    /// holds; more than the prompt has are cut). Those the local cache
    /// lacks get fresh blocks, returned in order as `(block, digest)`: the
    /// last `len` of the `remote` (the local hits come first):
    /// import their K/V (`KvCache::import_blocks`) before the sequence's
    /// first step; their tokens are not computed again, and the blocks
    /// join the local prefix cache. Should an import fail, [`uncache`](Self::uncache)
    /// the blocks and free the sequence, then add it again without them.
    /// Needs prefix caching on when `remote > 0`.
    pub fn add_sequence_with_remote(
        &mut self,
        prompt: &[u32],
        cache_salt: &[u8],
        remote: usize,
    ) -> Result<(SeqId, Vec<RemoteBlock>), BlockError> {
        self.add_sequence_capped(prompt, cache_salt, remote, usize::MAX)
    }

    /// [`add_sequence_with_remote`](Self::add_sequence_with_remote) sharing
    /// at most `cap` leading cached blocks: the layer groups of a hybrid
    /// scheduler agree on one hit (every layer computes the same tokens).
    pub(crate) fn add_sequence_capped(
        &mut self,
        prompt: &[u32],
        cache_salt: &[u8],
        remote: usize,
        cap: usize,
    ) -> Result<(SeqId, Vec<RemoteBlock>), BlockError> {
        if prompt.is_empty() {
            return Err(BlockError::EmptyPrompt);
        }
        self.check_len(prompt.len())?;
        if remote > 0 && !self.cfg.prefix_caching {
            return Err(BlockError::PrefixCachingOff);
        }
        let root = chain_root(cache_salt);
        let (mut matched, mut hashes) = self.lookup(prompt, &root);
        matched.truncate(cap);
        hashes.truncate(cap);
        // The whole chain only when a store holds blocks past the local hits.
        let remote_hashes: Vec<ChainDigest> = if remote > matched.len() {
            let all = self.prompt_hashes(prompt, cache_salt);
            all.get(matched.len()..remote.min(all.len()))
                .unwrap_or_default()
                .to_vec()
        } else {
            Vec::new()
        };
        let needed = self.blocks_for(prompt.len()) - matched.len();
        let revived = self.revived(&matched);
        let available = self.available_blocks() - revived;
        if needed > available {
            return Err(BlockError::OutOfBlocks {
                needed,
                free: available,
            });
        }
        for &b in &matched {
            self.retain(b);
        }
        let mut table = matched;
        let local_tokens = table.len() * self.cfg.block_size as usize;
        let mut imports = Vec::with_capacity(remote_hashes.len());
        // The imported blocks are not cached yet: they join the cache when
        // the step that imports them commits (`register_full_blocks`), so a
        // failed import leaves no other sequence on an unwritten block.
        for &h in &remote_hashes {
            let b = self.take_block();
            table.push(b);
            hashes.push(h);
            imports.push((b, h));
        }
        let imported = table.len() - imports.len()..table.len();
        let cached_tokens = table.len() * self.cfg.block_size as usize;
        let remote_tokens = cached_tokens - local_tokens;
        self.remote_hit_tokens += remote_tokens as u64;
        // The cache-hit cap: a prompt cached to its last token still
        // computes that token (its logits start the decode). Its K/V is in
        // the shared block already, so the step skips the write
        // (SKIP_WRITE) and the block stays shared.
        let skip_first = cached_tokens == prompt.len();
        let pending = (prompt.len() - cached_tokens).max(1);
        self.prefix_hit_tokens += (prompt.len() - pending).saturating_sub(remote_tokens) as u64;
        for _ in 0..needed - imports.len() {
            let b = self.take_block();
            table.push(b);
        }
        self.epoch += 1;
        let id = self.insert_seq(Sequence {
            table,
            tokens: prompt.to_vec(),
            pending,
            skip_first,
            swapped: false,
            hashes,
            root,
            imported,
        });
        Ok((id, imports))
    }

    /// Drops `blocks` from the prefix cache (a failed import's: their
    /// contents are not what their digests say); whoever holds them keeps
    /// them. Blocks not cached are passed over. Returns how many were
    /// dropped.
    pub fn uncache(&mut self, blocks: &[u32]) -> usize {
        let mut n = 0;
        for b in blocks {
            if let Some(h) = self.block_hash.remove(b) {
                self.cache.remove(&h);
                self.event(KvEvent::Removed { hash: h, block: *b });
                n += 1;
            }
        }
        if n > 0 {
            self.epoch += 1;
        }
        n
    }

    /// Holds a reference to each of `blocks` (held by a sequence, or
    /// cached), so none is reused while an export of it runs, even if its
    /// sequences end; [`unpin_blocks`](Self::unpin_blocks) drops them. A
    /// block that holds nothing (plain free) or is outside the pool is
    /// refused, and nothing changes.
    pub fn pin_blocks(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        for &b in blocks {
            let held = self.ref_counts.get(b as usize).is_some_and(|&r| r > 0);
            if !held && !self.block_hash.contains_key(&b) {
                return Err(BlockError::NotPinnable { block: b });
            }
        }
        for &b in blocks {
            self.retain(b);
            *self.pins.entry(b).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Drops references [`pin_blocks`](Self::pin_blocks) took (one per
    /// occurrence). A block not pinned that many times is refused, and
    /// nothing changes.
    pub fn unpin_blocks(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        let mut need: HashMap<u32, u32> = HashMap::new();
        for &b in blocks {
            *need.entry(b).or_insert(0) += 1;
        }
        for (&b, &n) in &need {
            if self.pins.get(&b).copied().unwrap_or(0) < n {
                return Err(BlockError::NotPinned { block: b });
            }
        }
        for &b in blocks {
            let p = self.pins.get_mut(&b).expect("checked");
            *p -= 1;
            if *p == 0 {
                self.pins.remove(&b);
            }
            self.release(b);
        }
        Ok(())
    }

    /// Records [`KvEvent`]s from now on (`on`), or stops and drops them.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(Vec::new);
    }

    /// The events since the last call (empty unless recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(super) fn event(&mut self, e: KvEvent) {
        if let Some(ev) = self.events.as_mut() {
            ev.push(e);
        }
    }

    /// Prompt tokens whose blocks a remote store supplied
    /// ([`add_sequence_with_remote`](Self::add_sequence_with_remote)).
    pub fn remote_hit_tokens(&self) -> u64 {
        self.remote_hit_tokens
    }

    /// Cached blocks matching the leading full blocks of `prompt`, with
    /// their chain digests.
    pub(super) fn lookup(
        &self,
        prompt: &[u32],
        root: &ChainDigest,
    ) -> (Vec<u32>, Vec<ChainDigest>) {
        let mut matched = Vec::new();
        let mut hashes = Vec::new();
        if self.cfg.prefix_caching {
            let mut h = *root;
            for chunk in prompt.chunks_exact(self.cfg.block_size as usize) {
                h = chain_hash(&h, chunk);
                match self.cache.get(&h) {
                    Some(&b) => {
                        matched.push(b);
                        hashes.push(h);
                    }
                    None => break,
                }
            }
        }
        (matched, hashes)
    }

    /// Of `matched` cached blocks, those a new reference takes out of the
    /// evictable pool.
    pub(super) fn revived(&self, matched: &[u32]) -> usize {
        matched
            .iter()
            .filter(|&&b| self.ref_counts[b as usize] == 0 && !self.awaiting_copy.contains(&b))
            .count()
    }

    /// Blocks [`add_sequence_salted`](Self::add_sequence_salted) would take
    /// from the pool for `prompt` now (prefix-cache hits not counted, cached
    /// blocks it would revive counted), without changing anything: what a
    /// scheduler checks before admitting a request.
    pub fn blocks_to_add(&self, prompt: &[u32], cache_salt: &[u8]) -> usize {
        self.blocks_to_add_capped(prompt, cache_salt, usize::MAX)
    }

    /// [`blocks_to_add`](Self::blocks_to_add) sharing at most `cap` cached
    /// blocks.
    pub(crate) fn blocks_to_add_capped(
        &self,
        prompt: &[u32],
        cache_salt: &[u8],
        cap: usize,
    ) -> usize {
        let (mut matched, _) = self.lookup(prompt, &chain_root(cache_salt));
        matched.truncate(cap);
        self.blocks_for(prompt.len()) - matched.len() + self.revived(&matched)
    }

    /// The cached blocks holding `prompt`'s leading full blocks in
    /// `cache_salt`'s namespace, in order (where the chain first misses,
    /// the list ends): what an engine exports for another to import.
    pub fn cached_blocks(&self, prompt: &[u32], cache_salt: &[u8]) -> Vec<u32> {
        self.lookup(prompt, &chain_root(cache_salt)).0
    }

    /// Leading full blocks of `prompt` this manager's prefix cache holds
    /// in `cache_salt`'s namespace.
    pub(crate) fn cached_prefix_blocks(&self, prompt: &[u32], cache_salt: &[u8]) -> usize {
        self.lookup(prompt, &chain_root(cache_salt)).0.len()
    }

    /// Drops every evictable cached block back to the plain free list.
    /// Returns how many were dropped.
    pub fn evict_all_cached(&mut self) -> usize {
        let n = self.evictable.len();
        if n > 0 {
            self.epoch += 1;
        }
        while let Some((_, b)) = self.evictable.pop_first() {
            if let Some(h) = self.block_hash.remove(&b) {
                self.cache.remove(&h);
                self.event(KvEvent::Removed { hash: h, block: b });
            }
            self.free.push(b);
        }
        n
    }

    pub(super) fn register_full_blocks(&mut self, id: SeqId) {
        let prefix = self.cfg.prefix_caching;
        let bs = self.cfg.block_size as usize;
        let s = self.seqs[id.index() as usize]
            .seq
            .as_mut()
            .expect("caller checked");
        if !prefix {
            return;
        }
        // Imported blocks first: the step that wrote them committed. A
        // block of the chain may be cached here already (past a gap): the
        // cached one stays.
        for i in std::mem::take(&mut s.imported) {
            let (b, h) = (s.table[i], s.hashes[i]);
            if b != RELEASED && !self.block_hash.contains_key(&b) {
                if let std::collections::hash_map::Entry::Vacant(e) = self.cache.entry(h) {
                    e.insert(b);
                    self.block_hash.insert(b, h);
                    if let Some(ev) = self.events.as_mut() {
                        ev.push(KvEvent::Stored { hash: h, block: b });
                    }
                }
            }
        }
        let full = (s.tokens.len() - s.pending) / bs;
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let parent = s.hashes.last().unwrap_or(&s.root);
            let h = chain_hash(parent, &s.tokens[i * bs..(i + 1) * bs]);
            s.hashes.push(h);
            let b = s.table[i];
            if b != RELEASED && !self.block_hash.contains_key(&b) {
                if let std::collections::hash_map::Entry::Vacant(e) = self.cache.entry(h) {
                    e.insert(b);
                    self.block_hash.insert(b, h);
                    if let Some(ev) = self.events.as_mut() {
                        ev.push(KvEvent::Stored { hash: h, block: b });
                    }
                }
            }
        }
    }
}

/// Root of a digest chain: the cache salt (namespace), domain-separated.
/// The empty salt is the default namespace.
fn chain_root(salt: &[u8]) -> ChainDigest {
    let mut h = Sha256::new();
    h.update(b"pagedattn prefix cache v1 root");
    h.update((salt.len() as u64).to_le_bytes());
    h.update(salt);
    h.finalize().into()
}

/// Digest of a full block given its parent's digest: SHA-256 over the
/// parent's digest and the block's token ids (little-endian). A cache hit
/// therefore means equal tokens, an equal chain before them and an equal
/// salt, short of a SHA-256 collision; unlike a fast 64-bit mix, nobody can
/// search for two prompts that share a key.
fn chain_hash(parent: &ChainDigest, tokens: &[u32]) -> ChainDigest {
    let mut h = Sha256::new();
    h.update(parent);
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(64) {
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.finalize().into()
}
