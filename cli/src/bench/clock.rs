//! The GPU's clocks beside each figure, where `nvidia-smi` exists: a
//! background `nvidia-smi --query-gpu=clocks.sm,clocks.mem -lms 100` whose
//! samples are kept with their time, so a measurement reports the median
//! SM clock over its own span. Clocks are read, never set.

use std::io::BufRead;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One sample: when, SM MHz, memory MHz.
type Sample = (Instant, u32, u32);

/// A running clock log; stops its `nvidia-smi` when dropped.
pub struct ClockLog {
    child: std::process::Child,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl ClockLog {
    /// Starts the logger; `None` where `nvidia-smi` is missing or fails.
    pub fn start() -> Option<Self> {
        let mut child = std::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=clocks.sm,clocks.mem",
                "--format=csv,noheader,nounits",
                "-lms",
                "100",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let out = child.stdout.take()?;
        let samples = Arc::new(Mutex::new(Vec::new()));
        let keep = samples.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some((sm, mem)) = parse(&line) {
                    if let Ok(mut v) = keep.lock() {
                        v.push((Instant::now(), sm, mem));
                    }
                }
            }
        });
        Some(Self { child, samples })
    }

    /// Median (SM MHz, memory MHz) of the samples taken since `since`;
    /// `None` without samples.
    pub fn median_since(&self, since: Instant) -> Option<(u32, u32)> {
        let v = self.samples.lock().ok()?;
        let mut sm: Vec<u32> = v.iter().filter(|s| s.0 >= since).map(|s| s.1).collect();
        let mut mem: Vec<u32> = v.iter().filter(|s| s.0 >= since).map(|s| s.2).collect();
        if sm.is_empty() {
            return None;
        }
        sm.sort_unstable();
        mem.sort_unstable();
        Some((sm[sm.len() / 2], mem[mem.len() / 2]))
    }
}

impl Drop for ClockLog {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `"1980, 3201"` as (1980, 3201).
fn parse(line: &str) -> Option<(u32, u32)> {
    let mut it = line.split(',').map(|f| f.trim().parse::<u32>());
    match (it.next(), it.next()) {
        (Some(Ok(sm)), Some(Ok(mem))) => Some((sm, mem)),
        _ => None,
    }
}

/// The rated memory bandwidth (GB/s) of known adapters, by lower-case name
/// substring (vendors' figures), for the bench's "% of rated".
pub const RATED_GBS: &[(&str, f64)] = &[
    ("h200", 4800.0),
    ("h100 pcie", 2000.0),
    ("h100", 3350.0),
    ("a100", 2039.0),
    ("l40s", 864.0),
    ("rtx 4090", 1008.0),
];

/// The rated bandwidth of the adapter called `name`, if known.
pub fn rated_gbs(name: &str) -> Option<f64> {
    let n = name.to_ascii_lowercase();
    RATED_GBS.iter().find(|(k, _)| n.contains(k)).map(|r| r.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_and_rated_bandwidth_parse() {
        assert_eq!(parse("1980, 3201"), Some((1980, 3201)));
        assert_eq!(parse("[N/A], 3201"), None);
        assert_eq!(rated_gbs("NVIDIA H200"), Some(4800.0));
        assert_eq!(rated_gbs("llvmpipe"), None);
    }
}
