//! The documents cite the code: every `path::name` in backticks in
//! README.md, ARCHITECTURE.md and GUARANTEES.md must name something the
//! workspace still defines (a function, test, type, constant, field or
//! module of that name), so that a rename or a removal that leaves a
//! document behind fails here instead of misleading a reader.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Every `.rs` and `.py` file under `dir` (skipping build output).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if !matches!(name, "target" | "node_modules" | "pkg" | ".git" | "corpus") {
                sources(&p, out);
            }
        } else if name.ends_with(".rs") || name.ends_with(".py") {
            out.push(p);
        }
    }
}

/// The names the code defines: items, fields, variants, modules, files.
fn defined(root: &Path) -> HashSet<String> {
    let mut files = Vec::new();
    sources(root, &mut files);
    let mut names = HashSet::new();
    for f in &files {
        if let Some(stem) = f.file_stem().and_then(|s| s.to_str()) {
            names.insert(stem.to_string());
        }
        let text = std::fs::read_to_string(f).unwrap_or_default();
        let words: Vec<&str> = text
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        for w in words.windows(2) {
            if matches!(
                w[0],
                "fn" | "struct" | "enum" | "const" | "type" | "mod" | "trait" | "static" | "def"
            ) {
                names.insert(w[1].to_string());
            }
        }
        // Fields and enum variants: `name:` and `Name {`/`Name(` at a line's
        // start are enough for what the documents cite.
        for line in text.lines() {
            let t = line.trim_start().trim_start_matches("pub ");
            let ident: String = t
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !ident.is_empty() {
                names.insert(ident);
            }
        }
    }
    names
}

/// First segments of paths into other crates and the standard library.
const EXTERNAL: [&str; 12] = [
    "wgpu", "std", "core", "u32", "u64", "usize", "f32", "f64", "half", "naga", "tokio", "redis",
];

/// The `a::b` (or longer) paths in backticks in `text`.
fn cited(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, chunk) in text.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        let c = chunk.trim();
        if c.contains("::")
            && c.split("::").all(|seg| {
                !seg.is_empty()
                    && seg
                        .chars()
                        .all(|ch| ch.is_alphanumeric() || ch == '_' || ch == '*')
            })
        {
            out.push(c.to_string());
        }
    }
    out
}

/// The citations in `text` that name nothing in `names`, and how many
/// were checked.
fn unresolved(text: &str, names: &HashSet<String>) -> (Vec<String>, usize) {
    let mut missing = Vec::new();
    let mut checked = 0;
    for c in cited(text) {
        // Paths into other crates and the standard library.
        let first = c.split("::").next().unwrap_or("");
        if EXTERNAL.contains(&first) {
            continue;
        }
        let last = c.rsplit("::").next().unwrap_or("");
        // `module::*`: the module.
        let name = if last == "*" {
            c.rsplit("::").nth(1).unwrap_or("")
        } else {
            last
        };
        // A wildcard in a name (`penalties_*`, `*_matches_the_f64_model`):
        // some name with that prefix or suffix.
        let prefix = name.trim_end_matches('*');
        let suffix = name.trim_start_matches('*');
        checked += 1;
        let found = names.contains(name)
            || (name.ends_with('*') && names.iter().any(|n| n.starts_with(prefix)))
            || (name.starts_with('*') && names.iter().any(|n| n.ends_with(suffix)));
        if !found {
            missing.push(c);
        }
    }
    (missing, checked)
}

#[test]
fn documents_cite_only_what_the_code_defines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let names = defined(root);
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in ["README.md", "ARCHITECTURE.md", "GUARANTEES.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let (m, n) = unresolved(&text, &names);
        missing.extend(m.into_iter().map(|c| format!("{doc}: `{c}`")));
        checked += n;
    }
    assert!(
        checked > 100,
        "only {checked} citations found: the scan is broken"
    );
    assert!(
        missing.is_empty(),
        "{} of {checked} citations name nothing the code defines:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

/// The check fails when a cited name is gone: a document citing a test
/// that exists and one that does not reports the second only.
#[test]
fn a_citation_of_a_removed_name_is_reported() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let names = defined(root);
    let doc = "Decode matches the reference (`gpu_decode::attention_variants`, \
               `gpu_decode::a_test_that_was_removed`, `wgpu::Limits`, `kernels::*_matches_the_f64_model`).";
    let (missing, checked) = unresolved(doc, &names);
    assert_eq!(checked, 3, "the external path is not checked");
    assert_eq!(missing, ["gpu_decode::a_test_that_was_removed"]);
}
