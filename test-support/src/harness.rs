//! What the input harnesses share (`gpu_args`, `calibration`, `block_ops`,
//! `scheduler_ops`, `cli_args`, `gguf_ops`, each included by its fuzz target
//! and by the tests that replay its corpus): counters of what inputs
//! reached, declared with [`tally!`], and the corpus replay around them.
#![allow(dead_code)]

use std::fmt::Debug;
use std::panic::UnwindSafe;
use std::path::{Path, PathBuf};

/// The files of the fuzz corpus in `dir`, sorted; there must be at least
/// `min` (a corpus that lost its files must not pass by reaching nothing).
pub fn corpus_files(dir: &Path, min: usize) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(
        files.len() >= min,
        "only {} files in {}",
        files.len(),
        dir.display()
    );
    files
}

/// Runs one input, naming it on stderr before its panic goes on.
pub fn caught<T>(what: &str, run: impl FnOnce() -> T + UnwindSafe) -> T {
    match std::panic::catch_unwind(run) {
        Ok(t) => t,
        Err(p) => {
            eprintln!("{what} failed");
            std::panic::resume_unwind(p);
        }
    }
}

/// Asserts that `from` reached every count of `named` but those in `skip`.
pub fn assert_reached<N>(named: &[(&'static str, N)], from: &str, skip: &[&str])
where
    N: Copy + Debug + Default + PartialOrd,
{
    for &(what, n) in named {
        if !skip.contains(&what) {
            assert!(n > N::default(), "{from} never reaches {what}: {named:?}");
        }
    }
}

/// `tally! { pub struct Name: u64 { field: "what it counts", ... } }`
/// declares the struct (each field public, `Default` zero) with `add`, which
/// sums another into it, and `named`, every count with its name in order.
#[macro_export]
macro_rules! tally {
    (
        $(#[$meta:meta])*
        pub struct $name:ident: $count:ty {
            $($(#[$fmeta:meta])* $field:ident: $what:literal,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $count,)*
        }

        #[allow(dead_code)]
        impl $name {
            /// Adds every count of `o` to this one's.
            pub fn add(&mut self, o: &$name) {
                $(self.$field += o.$field;)*
            }

            /// Every count with its name, in declaration order.
            pub fn named(&self) -> Vec<(&'static str, $count)> {
                vec![$(($what, self.$field)),*]
            }
        }
    };
}

/// A fuzz input read a byte at a time: zeros once it runs out, so any
/// input, however short, drives a whole run. Each harness adds the readers
/// of its own values (`impl harness::Input<'_>`).
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

#[allow(dead_code)]
impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data, pos: 0 }
    }

    /// The next byte, or 0 past the end.
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    /// Whether every byte has been read.
    pub fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
}
