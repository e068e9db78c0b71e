//! A request's live state in a simulated run: its sequences (samples or
//! beams), their target lengths and its seeded decode stream.

use super::workload::{Request, Sampling};
use pagedattn::rng::SplitMix64;

/// One sequence of a request (a sample or a beam).
#[derive(Clone, Debug)]
pub(super) struct Seq {
    /// Tokens generated so far (the prompt is the request's).
    pub tail: Vec<u32>,
    /// Tokens it will have generated when it finishes.
    pub target: usize,
}

/// A request that has arrived and not finished: queued or running.
#[derive(Clone, Debug)]
pub(super) struct Live {
    /// Index into the workload.
    pub req: usize,
    /// Its live sequences.
    pub seqs: Vec<Seq>,
    /// Decode stream of this request.
    pub rng: SplitMix64,
    /// Whether it has been admitted before (a readmission is a recompute).
    pub admitted: bool,
}

impl Live {
    pub(super) fn new(req: &Request, sampling: Sampling, seed: u64) -> Self {
        let seq = |target| Seq {
            tail: Vec::new(),
            target,
        };
        let seqs = match sampling {
            Sampling::Parallel(_) => req.outputs.iter().map(|&t| seq(t)).collect(),
            Sampling::Beam(_) => vec![seq(req.outputs[0])],
        };
        let mut rng = SplitMix64::new(
            seed ^ 0xDEC0_DE00_0000_0000 ^ (req.id as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        rng.next_u64();
        Self {
            req: req.id,
            seqs,
            rng,
            admitted: false,
        }
    }
}
