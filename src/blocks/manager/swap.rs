//! Swapping sequences out to host memory and back.

use super::*;

impl BlockManager {
    /// Swaps a sequence group (all the samples or beams of a request) out
    /// to host swap space: every distinct block the group holds (a block
    /// shared inside the group counted once) gets a host block, and the
    /// group's references to the pool blocks are dropped. Returns the
    /// copies `(pool block, host block)` to run before the pool blocks are
    /// reused (`KvCache::swap_out`). Sharing inside the group survives the
    /// round trip; a sequence's pending tokens stay pending.
    ///
    /// Errors, leaving everything unchanged: an unknown, swapped-out or
    /// repeated sequence; pending copy-on-write copies
    /// (`BlockError::CopiesPending`: take them first); too little swap space.
    pub fn swap_out(&mut self, group: &[SeqId]) -> Result<Vec<[u32; 2]>, BlockError> {
        self.check_group(group, false)?;
        if !self.copies.is_empty() {
            return Err(BlockError::CopiesPending(self.copies.len()));
        }
        let mut distinct: Vec<u32> = Vec::new();
        let mut seen = HashSet::new();
        for &id in group {
            for &b in &self.seq(id)?.table {
                if b != RELEASED && seen.insert(b) {
                    distinct.push(b);
                }
            }
        }
        if distinct.len() > self.swap_free.len() {
            return Err(BlockError::SwapSpaceFull {
                needed: distinct.len(),
                free: self.swap_free.len(),
            });
        }
        self.epoch += 1;
        let mut map = HashMap::with_capacity(distinct.len());
        let mut pairs = Vec::with_capacity(distinct.len());
        for &b in &distinct {
            let h = self.swap_free.pop().expect("checked above");
            map.insert(b, h);
            pairs.push([b, h]);
        }
        for &id in group {
            let table = std::mem::take(&mut self.seq_mut(id).table);
            let mut host = Vec::with_capacity(table.len());
            for &b in &table {
                if b == RELEASED {
                    host.push(RELEASED);
                } else {
                    let h = map[&b];
                    self.swap_refs[h as usize] += 1;
                    host.push(h);
                    self.release(b);
                }
            }
            let s = self.seq_mut(id);
            s.table = host;
            s.swapped = true;
        }
        Ok(pairs)
    }

    /// Swaps a group back in, to newly taken pool blocks: returns the
    /// copies `(host block, pool block)` to run before the group's next
    /// step (`KvCache::swap_in`). Blocks shared inside `group` are shared
    /// again; host blocks still held by sequences swapped out with them but
    /// not named here stay in swap space. Full blocks go back to the prefix
    /// cache where their content is not cached already.
    ///
    /// Errors, leaving everything unchanged: an unknown, resident or
    /// repeated sequence, or too few free pool blocks.
    pub fn swap_in(&mut self, group: &[SeqId]) -> Result<Vec<[u32; 2]>, BlockError> {
        self.check_group(group, true)?;
        let needed = self.swap_in_blocks(group)?;
        let available = self.available_blocks();
        if needed > available {
            return Err(BlockError::OutOfBlocks {
                needed,
                free: available,
            });
        }
        self.epoch += 1;
        let mut map: HashMap<u32, u32> = HashMap::with_capacity(needed);
        let mut pairs = Vec::with_capacity(needed);
        for &id in group {
            let table = std::mem::take(&mut self.seq_mut(id).table);
            let mut pool = Vec::with_capacity(table.len());
            for &h in &table {
                if h == RELEASED {
                    pool.push(RELEASED);
                    continue;
                }
                let b = match map.get(&h) {
                    Some(&b) => {
                        self.ref_counts[b as usize] += 1;
                        b
                    }
                    None => {
                        let b = self.take_block();
                        map.insert(h, b);
                        pairs.push([h, b]);
                        b
                    }
                };
                pool.push(b);
                self.release_swap(h);
            }
            let s = self.seq_mut(id);
            s.table = pool;
            s.swapped = false;
            if self.cfg.prefix_caching {
                let s = self.seqs[id.index() as usize]
                    .seq
                    .as_ref()
                    .expect("checked");
                let back: Vec<(u32, ChainDigest)> = s
                    .hashes
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| s.table[i] != RELEASED)
                    .map(|(i, h)| (s.table[i], *h))
                    .collect();
                for (b, h) in back {
                    if !self.block_hash.contains_key(&b) && !self.cache.contains_key(&h) {
                        self.cache.insert(h, b);
                        self.block_hash.insert(b, h);
                    }
                }
            }
        }
        Ok(pairs)
    }

    /// Host blocks [`swap_out`](Self::swap_out) of `group` would take (its
    /// distinct resident blocks).
    pub(crate) fn swap_out_blocks(&self, group: &[SeqId]) -> Result<usize, BlockError> {
        let mut seen: HashSet<u32> = HashSet::new();
        for &id in group {
            seen.extend(self.resident(id)?.table.iter().filter(|&&b| b != RELEASED));
        }
        Ok(seen.len())
    }

    /// Pool blocks [`swap_in`](Self::swap_in) of `group` would take.
    pub fn swap_in_blocks(&self, group: &[SeqId]) -> Result<usize, BlockError> {
        let mut seen: HashSet<u32> = HashSet::new();
        for &id in group {
            let s = self.seq(id)?;
            if !s.swapped {
                return Err(BlockError::NotSwapped(id));
            }
            seen.extend(s.table.iter().filter(|&&h| h != RELEASED));
        }
        Ok(seen.len())
    }

    pub(super) fn release_swap(&mut self, h: u32) {
        let r = &mut self.swap_refs[h as usize];
        *r -= 1;
        if *r == 0 {
            self.swap_free.push(h);
        }
    }

    /// Every id live, distinct, and swapped out (or not) as `swapped` says.
    pub(super) fn check_group(&self, group: &[SeqId], swapped: bool) -> Result<(), BlockError> {
        let mut seen = HashSet::with_capacity(group.len());
        for &id in group {
            let s = self.seq(id)?;
            if s.swapped != swapped {
                return Err(if swapped {
                    BlockError::NotSwapped(id)
                } else {
                    BlockError::Swapped(id)
                });
            }
            if !seen.insert(id) {
                return Err(BlockError::DuplicateInBatch(id));
            }
        }
        Ok(())
    }
}
