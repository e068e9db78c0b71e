//! One step scheduled: preemption, chunked prefill, admission under the reservation policy, and its rows.

use super::*;

impl Scheduler {
    pub(super) fn preempt(&mut self, mut g: Group, step: &mut Step) -> Result<(), SchedulerError> {
        let single = g.seqs.len() == 1 && g.children.iter().filter(|c| !c.finished).count() <= 1;
        let mut mode = match self.cfg.preemption {
            Preemption::Auto if single => Preemption::Recompute,
            Preemption::Auto => Preemption::Swap,
            p => p,
        };
        if mode == Preemption::Swap {
            match self.blocks.swap_out(&g.seqs) {
                Ok(pairs) => {
                    self.stats.swapped_groups += 1;
                    self.stats.blocks_swapped_out += pairs[0].len() as u64;
                    step.add_swaps(pairs, true);
                    step.preempted.push((g.id, Preemption::Swap));
                    let at = self.swapped.partition_point(|x| x.id < g.id);
                    self.swapped.insert(at, g);
                    return Ok(());
                }
                Err(BlockError::SwapSpaceFull { .. }) => {
                    self.stats.swap_fallbacks += 1;
                    mode = Preemption::Recompute;
                }
                Err(e) => return Err(e.into()),
            }
        }
        debug_assert_eq!(mode, Preemption::Recompute);
        let mut sources = Vec::new();
        let live: Vec<Child> = g.children.iter().filter(|c| !c.finished).copied().collect();
        if !g.targets.is_empty() {
            // Still regrowing from an earlier recompute: the same sources.
            sources = std::mem::take(&mut g.sources);
        } else if live.is_empty() {
            for &id in &g.seqs {
                sources.push(self.blocks.tokens(id)?.to_vec());
            }
        } else {
            for c in &live {
                let mut t = self.blocks.tokens(g.seqs[c.parent])?.to_vec();
                t.push(c.token);
                sources.push(t);
            }
        }
        for &id in &g.seqs {
            let written = self.blocks.seq_len(id)? - self.blocks.pending_tokens(id)?;
            self.stats.tokens_recomputed += written as u64;
            self.blocks.free(id)?;
        }
        g.seqs.clear();
        g.children.clear();
        g.targets.clear();
        g.sources = sources;
        self.stats.recomputed_groups += 1;
        step.preempted.push((g.id, Preemption::Recompute));
        let at = self.waiting.partition_point(|x| x.id < g.id);
        self.waiting.insert(at, g);
        Ok(())
    }

    /// Chunks of a group's sequences within `budget` tokens: everything
    /// when it fits (every sequence then yields logits), else chunks that
    /// hold back each sequence's last pending token, so that a group's
    /// sequences reach their logits in the same step.
    pub(super) fn chunks(&self, g: &Group, budget: usize) -> Result<Vec<usize>, BlockError> {
        let pending: Vec<usize> = g
            .seqs
            .iter()
            .map(|&id| self.blocks.pending_tokens(id))
            .collect::<Result<_, _>>()?;
        let total: usize = pending.iter().sum();
        if total <= budget && g.targets.is_empty() {
            return Ok(pending);
        }
        // While regrowing, a shared prefix is written whole (it then
        // splits), and a sequence standing for one source keeps its last
        // token back until the group has regrown, so that every sequence
        // reaches its logits in the same step.
        let mut left = budget;
        Ok(pending
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let whole = g.targets.get(i).is_some_and(|t| t.len() > 1);
                let c = if whole { p } else { p.saturating_sub(1) }.min(left);
                left -= c;
                c
            })
            .collect())
    }

    /// Pool blocks the next split of a regrowing group takes: per
    /// sequence written up to its shared prefix, the blocks its parts'
    /// appends take (copying the partly filled last block for all but one).
    pub(super) fn regrow_cost(&self, g: &Group) -> Result<usize, BlockError> {
        let bs = self.blocks.block_size() as usize;
        let mut total = 0;
        for (i, &id) in g.seqs.iter().enumerate() {
            let Some(members) = g.targets.get(i).filter(|t| t.len() > 1) else {
                continue;
            };
            if self.blocks.pending_tokens(id)? > 0 {
                continue;
            }
            let len = self.blocks.seq_len(id)?;
            let parts = splits(&g.sources, members, len);
            total += parts
                .iter()
                .map(|(_, end)| end.div_ceil(bs) - len / bs)
                .sum::<usize>();
            if len % bs != 0 {
                total -= 1; // the last to append keeps the original block
            }
        }
        Ok(total)
    }

    /// Splits every written shared prefix of a regrowing group (forks
    /// first, then the appends); once each sequence stands for one source,
    /// puts them back in the group's order and ends the regrowth. The
    /// caller checked the blocks ([`regrow_cost`](Self::regrow_cost)).
    pub(super) fn regrow(blocks: &mut Pools, g: &mut Group) -> Result<(), BlockError> {
        if g.targets.is_empty() {
            return Ok(());
        }
        let mut seqs = Vec::with_capacity(g.width);
        let mut targets = Vec::with_capacity(g.width);
        let mut appends = Vec::new();
        for (i, &id) in g.seqs.iter().enumerate() {
            let members = std::mem::take(&mut g.targets[i]);
            if members.len() == 1 || blocks.pending_tokens(id)? > 0 {
                seqs.push(id);
                targets.push(members);
                continue;
            }
            let len = blocks.seq_len(id)?;
            for (k, (part, end)) in splits(&g.sources, &members, len).into_iter().enumerate() {
                let sid = if k == 0 { id } else { blocks.fork(id)? };
                appends.push((sid, part[0], len, end));
                seqs.push(sid);
                targets.push(part);
            }
        }
        for (sid, j, len, end) in appends {
            blocks.append(sid, &g.sources[j][len..end])?;
        }
        if targets.iter().all(|t| t.len() == 1) {
            let mut order: Vec<(usize, SeqId)> = targets.iter().map(|t| t[0]).zip(seqs).collect();
            order.sort_unstable_by_key(|&(j, _)| j);
            g.seqs = order.into_iter().map(|(_, id)| id).collect();
            g.targets.clear();
            g.sources.clear();
        } else {
            g.seqs = seqs;
            g.targets = targets;
        }
        Ok(())
    }

    /// Blocks admitting a waiting group takes in the end (prefix-cache hits
    /// not counted), and the length of the shared prefix it regrows from
    /// (0: its sources are added as they are).
    pub(super) fn admission_blocks(&self, g: &Group) -> (Need, usize) {
        let bs = self.blocks.block_size() as usize;
        let all: Vec<usize> = (0..g.sources.len()).collect();
        let shared = if g.sources.len() > 1 {
            shared_len(&g.sources, &all)
        } else {
            0
        };
        if shared == 0 {
            let mut n = Need::zero(self.blocks.len());
            for s in &g.sources {
                n += self.blocks.blocks_to_add(s, &g.salt);
            }
            return (n, 0);
        }
        let prefix = &g.sources[0][..shared];
        let n = self.blocks.blocks_to_add(prefix, &g.salt) + regrown_blocks(&g.sources, bs)
            - shared.div_ceil(bs);
        (n, shared)
    }

    /// Decides the next step. See [`Step`] for what to run.
    pub fn schedule(&mut self) -> Result<Step, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::StepOrder(
                "schedule while the previous step awaits its commit",
            ));
        }
        // Every input was checked when it arrived (add_request, commit), so
        // an error below is a broken invariant, reported instead of a panic.
        self.schedule_inner()
    }

    pub(super) fn schedule_inner(&mut self) -> Result<Step, SchedulerError> {
        let mut step = Step::default();
        self.make_room(&mut step)?;
        let preempted = !step.preempted.is_empty();
        let width = self.swap_back(preempted, &mut step)?;
        let mut b = Batching {
            budget: self.cfg.max_batch_tokens,
            rows: Vec::new(),
            owners: Vec::new(),
            in_batch: 0,
            width,
        };
        self.batch_running(&mut b)?;
        if !preempted {
            self.admit(&mut b, &mut step)?;
        }
        self.emit_rows(&b, &mut step)?;
        self.steps += 1;
        self.stats.steps += 1;
        step.number = self.steps;
        step.owner = self.blocks.owner();
        self.in_flight = Some(self.steps);
        Ok(step)
    }

    /// Step 1 of [`schedule`](Self::schedule): room for the running groups'
    /// children, preempting the newest arrivals until there is.
    pub(super) fn make_room(&mut self, step: &mut Step) -> Result<(), SchedulerError> {
        loop {
            let mut need = Need::zero(self.blocks.len());
            for g in &self.running {
                need += self.children_cost(g)? + self.regrow_cost(g)?;
            }
            if !need.exceeds(&self.blocks.available()) {
                break;
            }
            let victim = self.running.pop().expect("need > 0 means a running group");
            if self.running.is_empty() {
                // Alone, with every other block free or evictable, it still
                // does not fit: preempting it would only bring it back.
                for &id in &victim.seqs {
                    self.blocks.free(id)?;
                }
                self.stats.aborted += 1;
                step.aborted.push(victim.id);
                continue;
            }
            self.preempt(victim, step)?;
        }
        for g in &mut self.running {
            Self::apply_children(&mut self.blocks, g)?;
            Self::regrow(&mut self.blocks, g)?;
        }
        Ok(())
    }

    /// Step 2: swapped groups back in, oldest first, when nothing was
    /// preempted this step. Returns the running groups' width.
    pub(super) fn swap_back(
        &mut self,
        preempted: bool,
        step: &mut Step,
    ) -> Result<usize, SchedulerError> {
        // Running groups are counted at their width (what they may grow
        // to), so the sequences held never pass `max_seqs`.
        let mut width: usize = self.running.iter().map(|g| g.width).sum();
        // Their children are applied once every swap-in is chosen: a parent
        // pruned then frees a block that no later swap-in of this step may
        // take (one step never writes a pool block twice by swapping).
        let mut back: Vec<RequestId> = Vec::new();
        let mut reserved = 0usize;
        while let (false, Some(g)) = (preempted, self.swapped.front()) {
            let grow = g.children.iter().filter(|c| !c.finished).count();
            let need = self.blocks.swap_in_blocks(&g.seqs)? + grow + self.regrow_cost(g)?;
            let idle = self.running.is_empty();
            let wm = if idle { 0 } else { self.cfg.watermark_blocks };
            let available = self.blocks.available();
            if (need + reserved + wm).exceeds(&available) || width + g.width > self.cfg.max_seqs {
                if idle && need.exceeds(&available) {
                    // With the pool to itself it still cannot come back
                    // and grow: it never will. Drop it.
                    let g = self.swapped.pop_front().expect("front exists");
                    for &id in &g.seqs {
                        self.blocks.free(id)?;
                    }
                    self.stats.aborted += 1;
                    step.aborted.push(g.id);
                    continue;
                }
                break;
            }
            let g = self.swapped.pop_front().expect("front exists");
            let pairs = self.blocks.swap_in(&g.seqs)?;
            self.stats.blocks_swapped_in += pairs[0].len() as u64;
            step.add_swaps(pairs, false);
            reserved += grow;
            width += g.width;
            back.push(g.id);
            let at = self.running.partition_point(|x| x.id < g.id);
            self.running.insert(at, g);
        }
        for g in self.running.iter_mut().filter(|g| back.contains(&g.id)) {
            Self::apply_children(&mut self.blocks, g)?;
            Self::regrow(&mut self.blocks, g)?;
        }
        Ok(width)
    }

    /// Step 3: the token budget for the running groups, in arrival order
    /// (decodes take one token a sequence).
    pub(super) fn batch_running(&mut self, b: &mut Batching) -> Result<(), SchedulerError> {
        for gi in 0..self.running.len() {
            let g = &self.running[gi];
            if b.in_batch + g.seqs.len() > self.cfg.max_seqs || b.budget == 0 {
                continue;
            }
            let chunks = self.chunks(g, b.budget)?;
            let sum: usize = chunks.iter().sum();
            if sum == 0 {
                continue;
            }
            b.budget -= sum;
            b.in_batch += g.seqs.len();
            for (si, (&id, &c)) in g.seqs.iter().zip(&chunks).enumerate() {
                if c > 0 {
                    b.rows.push((id, c));
                    b.owners.push((gi, si));
                }
            }
        }
        Ok(())
    }

    /// Step 4: admissions from the waiting queue, first come first served
    /// (not called in a step that preempted).
    pub(super) fn admit(
        &mut self,
        b: &mut Batching,
        step: &mut Step,
    ) -> Result<(), SchedulerError> {
        while b.budget > 0 && self.swapped.is_empty() {
            let Some(g) = self.waiting.front() else { break };
            if b.in_batch + g.sources.len() > self.cfg.max_seqs
                || b.width + g.width > self.cfg.max_seqs
            {
                break;
            }
            // The watermark keeps room for running groups to grow; with
            // none, it would only keep the pool idle.
            // Headroom of one block per sequence to grow; an idle pool
            // admits without it (it would only wait for itself).
            let idle = self.running.is_empty();
            if g.reserve > 0 && self.reserved_blocks() + g.reserve > self.blocks.min_blocks() {
                // Its slab does not fit beside the others': it waits.
                break;
            }
            let (blocks, shared) = self.admission_blocks(g);
            let need = blocks + g.width + if idle { 0 } else { self.cfg.watermark_blocks };
            let available = self.blocks.available();
            if need.exceeds(&available) {
                if idle && blocks.exceeds(&available) {
                    // Nothing runs or is swapped out: every block is free or
                    // evictable, and it still does not fit (a recompute of a
                    // group grown past the pool). It never will: drop it.
                    let g = self.waiting.pop_front().expect("front exists");
                    self.stats.aborted += 1;
                    step.aborted.push(g.id);
                    continue;
                }
                if !idle {
                    break;
                }
            }
            let mut g = self.waiting.pop_front().expect("front exists");
            b.width += g.width;
            if shared > 0 {
                // A recomputed group of several sequences: its shared
                // prefix once; it forks where they part (`regrow`).
                let id = self
                    .blocks
                    .add_sequence_salted(&g.sources[0][..shared], &g.salt)?;
                g.seqs.push(id);
                g.targets.push((0..g.sources.len()).collect());
            } else {
                let remote = std::mem::take(&mut g.remote);
                for s in std::mem::take(&mut g.sources) {
                    let (id, imports) =
                        self.blocks.add_sequence_with_remote(&s, &g.salt, remote)?;
                    step.add_imports(g.id, imports);
                    g.seqs.push(id);
                }
            }
            let chunks = self.chunks(&g, b.budget)?;
            let sum: usize = chunks.iter().sum();
            b.budget -= sum;
            let at = self.running.partition_point(|x| x.id < g.id);
            // Owners index the running list: shift those at or after `at`.
            for o in b.owners.iter_mut() {
                if o.0 >= at {
                    o.0 += 1;
                }
            }
            if sum > 0 {
                b.in_batch += g.seqs.len();
                for (si, (&id, &c)) in g.seqs.iter().zip(&chunks).enumerate() {
                    if c > 0 {
                        b.rows.push((id, c));
                        b.owners.push((at, si));
                    }
                }
            }
            self.running.insert(at, g);
        }
        Ok(())
    }

    /// Step 5: the plan of the chosen rows, the rows and their token ids,
    /// and the groups that sample.
    pub(super) fn emit_rows(
        &mut self,
        b: &Batching,
        step: &mut Step,
    ) -> Result<(), SchedulerError> {
        step.more
            .resize_with(self.blocks.len() - 1, Default::default);
        let plans =
            std::iter::once(&mut step.plan).chain(step.more.iter_mut().map(|w| &mut w.plan));
        self.blocks.plan_step_into(&b.rows, plans)?;
        let mut last_group = usize::MAX;
        for (i, &(gi, si)) in b.owners.iter().enumerate() {
            let g = &self.running[gi];
            let id = g.seqs[si];
            let tokens = self.blocks.tokens(id)?;
            let end = step.plan.view().seq_lens[i] as usize;
            let start = end - step.plan.chunks()[i];
            step.tokens.extend_from_slice(&tokens[start..end]);
            step.rows.push(Row {
                request: g.id,
                index: si,
                seq: id,
                positions: start..end,
                logits: step.plan.completes()[i]
                    && step.plan.chunks()[i] > 0
                    && g.targets.is_empty(),
            });
            // A group's rows are adjacent: it samples when every one of its
            // sequences is in the batch and reaches its logits.
            if gi != last_group {
                last_group = gi;
                let n = g.seqs.len();
                let all = b
                    .owners
                    .get(i..i + n)
                    .is_some_and(|o| o.iter().all(|&(a, _)| a == gi))
                    && step.plan.completes()[i..i + n].iter().all(|&c| c);
                if all && g.targets.is_empty() {
                    step.sample.push(g.id);
                }
            }
        }
        Ok(())
    }

    /// Commits a step once the model ran it: the rows' tokens count as
    /// written, and each group in `step.sample` continues with the children
    /// in `outputs` (applied at the next [`schedule`](Self::schedule)).
    /// Returns the requests that ended. Refused, changing nothing, if
    /// `outputs` does not name exactly the groups in `step.sample` or names
    /// a parent the group does not have, or more live children than its
    /// width.
    pub fn commit(
        &mut self,
        step: &Step,
        outputs: &[GroupOutput],
    ) -> Result<Vec<Finished>, SchedulerError> {
        if self.in_flight != Some(step.number) || step.owner != self.blocks.owner() {
            return Err(SchedulerError::StepOrder(
                "commit of a step that is not in flight",
            ));
        }
        if outputs.len() != step.sample.len() {
            return Err(SchedulerError::BadOutput(format!(
                "{} groups sampled in this step, {} outputs given",
                step.sample.len(),
                outputs.len()
            )));
        }
        for o in outputs {
            if !step.sample.contains(&o.request) {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} did not sample in this step",
                    o.request
                )));
            }
            if outputs.iter().filter(|x| x.request == o.request).count() > 1 {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} named twice",
                    o.request
                )));
            }
            let g = self
                .running
                .iter()
                .find(|g| g.id == o.request)
                .ok_or(SchedulerError::UnknownRequest(o.request))?;
            if let Some(c) = o.children.iter().find(|c| c.parent >= g.seqs.len()) {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} has {} sequences; a child names parent {}",
                    o.request,
                    g.seqs.len(),
                    c.parent
                )));
            }
            let live = o.children.iter().filter(|c| !c.finished).count();
            if live > g.width {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} continues with {live} sequences, more than its width {}",
                    o.request, g.width
                )));
            }
            let longest = o
                .children
                .iter()
                .filter(|c| !c.finished)
                .map(|c| self.blocks.seq_len(g.seqs[c.parent]).unwrap_or(0) + 1)
                .max()
                .unwrap_or(0);
            let limit = self.blocks.config().max_seq_len;
            if longest > limit {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} would grow to {longest} tokens, past the limit of {limit}",
                    o.request
                )));
            }
        }
        let plans = std::iter::once(&step.plan).chain(step.more.iter().map(|w| &w.plan));
        self.blocks.commit_step(plans)?;
        self.in_flight = None;
        let mut ended = Vec::new();
        for o in outputs {
            let gi = self
                .running
                .iter()
                .position(|g| g.id == o.request)
                .expect("checked above");
            let g = &mut self.running[gi];
            for c in o.children.iter().filter(|c| c.finished) {
                let mut t = self.blocks.tokens(g.seqs[c.parent])?.to_vec();
                t.push(c.token);
                g.done.push(t);
            }
            g.children = o.children.clone();
            if o.children.iter().all(|c| c.finished) {
                let g = self.running.remove(gi);
                for &id in &g.seqs {
                    self.blocks.free(id)?;
                }
                self.stats.finished += 1;
                ended.push(Finished {
                    request: g.id,
                    sequences: g.done,
                });
            }
        }
        Ok(ended)
    }
}
