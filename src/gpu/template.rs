//! A small line template: the one way the library generates WGSL (every
//! shape's constants, the lanes kernel's row helpers, the rows kernel's
//! layout, the serial and stream kernels' unrolled code; all in
//! `shaders/templates/`): loops and conditions over integer names, so the
//! generated code is read as a file, not as Rust string building.
//!
//! - `//#for NAME in LO..HI` ... `//#end` repeats its lines with `NAME`
//!   from `LO` up to (not including) `HI`;
//! - `//#if COND`, `//#elif COND`, `//#else`, `//#end` keep one branch;
//!   `COND` is an expression (true when not 0) or two compared with `==`,
//!   `!=`, `<`, `<=`, `>` or `>=`;
//! - `{{EXPR}}` in a line is replaced by the value of `EXPR`: integers,
//!   names, `+ - * / %` and parentheses; `swz4(EXPR)` gives a vec4's
//!   component (`x`..`w`), `swz2(EXPR)` its half (`xy` or `zw`),
//!   `bool(EXPR)` `false` or `true` for 0 or 1;
//! - any other line starting `//#` is a comment of the template and is
//!   dropped.
//!
//! Templates are the library's own files: an error (an unknown name, an
//! unclosed block) is a bug in the library, reported by the tests that
//! expand every template.

/// A parsed template line or block.
#[derive(Debug)]
enum Node<'a> {
    Text(&'a str),
    For {
        name: &'a str,
        lo: &'a str,
        hi: &'a str,
        body: Vec<Node<'a>>,
    },
    /// (condition, body) per branch; `else` has the condition `None`.
    If(Vec<(Option<&'a str>, Vec<Node<'a>>)>),
}

/// Expands `template` with `vars`; the error says which line is wrong.
pub fn expand(template: &str, vars: &[(&str, i64)]) -> Result<String, String> {
    let lines: Vec<&str> = template.lines().collect();
    let mut at = 0;
    let nodes = parse(&lines, &mut at, false)?;
    if at != lines.len() {
        return Err(format!("line {}: `//#end` without a block", at + 1));
    }
    let mut env: Vec<(String, i64)> = vars.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let mut out = String::new();
    render(&nodes, &mut env, &mut out)?;
    Ok(out)
}

fn directive(line: &str) -> Option<&str> {
    line.trim_start().strip_prefix("//#")
}

/// Parses lines from `at` up to the `//#end`, `//#elif` or `//#else` that
/// closes the block (left at `at`), or the end when `inner` is false.
fn parse<'a>(lines: &[&'a str], at: &mut usize, inner: bool) -> Result<Vec<Node<'a>>, String> {
    let mut nodes = Vec::new();
    while *at < lines.len() {
        let line = lines[*at];
        let Some(d) = directive(line) else {
            nodes.push(Node::Text(line));
            *at += 1;
            continue;
        };
        let d = d.trim();
        let word = d.split_whitespace().next().unwrap_or("");
        match word {
            "end" | "elif" | "else" => {
                if inner {
                    return Ok(nodes);
                }
                return Err(format!("line {}: `//#{word}` outside a block", *at + 1));
            }
            "for" => {
                let rest = d["for".len()..].trim();
                let (name, range) = rest
                    .split_once(" in ")
                    .ok_or_else(|| format!("line {}: `//#for NAME in LO..HI`", *at + 1))?;
                let (lo, hi) = range
                    .split_once("..")
                    .ok_or_else(|| format!("line {}: a range LO..HI", *at + 1))?;
                *at += 1;
                let body = parse(lines, at, true)?;
                expect_end(lines, at)?;
                nodes.push(Node::For {
                    name: name.trim(),
                    lo: lo.trim(),
                    hi: hi.trim(),
                    body,
                });
            }
            "if" => {
                let mut branches = vec![(Some(d["if".len()..].trim()), Vec::new())];
                *at += 1;
                loop {
                    let body = parse(lines, at, true)?;
                    branches.last_mut().expect("a branch").1 = body;
                    let Some(next) = lines.get(*at).and_then(|l| directive(l)) else {
                        return Err("an `//#if` without its `//#end`".into());
                    };
                    let next = next.trim();
                    *at += 1;
                    if next == "end" {
                        break;
                    } else if next == "else" {
                        branches.push((None, Vec::new()));
                    } else if let Some(c) = next.strip_prefix("elif") {
                        branches.push((Some(c.trim()), Vec::new()));
                    } else {
                        return Err(format!("line {}: unexpected `//#{next}`", *at));
                    }
                }
                nodes.push(Node::If(branches));
            }
            // A comment of the template.
            _ => *at += 1,
        }
    }
    if inner {
        return Err("a block without its `//#end`".into());
    }
    Ok(nodes)
}

fn expect_end(lines: &[&str], at: &mut usize) -> Result<(), String> {
    match lines.get(*at).and_then(|l| directive(l)).map(str::trim) {
        Some("end") => {
            *at += 1;
            Ok(())
        }
        _ => Err(format!("line {}: a `//#for` ends with `//#end`", *at + 1)),
    }
}

fn render(nodes: &[Node], env: &mut Vec<(String, i64)>, out: &mut String) -> Result<(), String> {
    for n in nodes {
        match n {
            Node::Text(line) => {
                substitute(line, env, out)?;
                out.push('\n');
            }
            Node::For { name, lo, hi, body } => {
                let (lo, hi) = (eval(lo, env)?, eval(hi, env)?);
                for i in lo..hi {
                    env.push((name.to_string(), i));
                    let r = render(body, env, out);
                    env.pop();
                    r?;
                }
            }
            Node::If(branches) => {
                for (cond, body) in branches {
                    let take = match cond {
                        Some(c) => condition(c, env)?,
                        None => true,
                    };
                    if take {
                        render(body, env, out)?;
                        break;
                    }
                }
            }
        }
    }
    Ok(())
}

fn substitute(line: &str, env: &[(String, i64)], out: &mut String) -> Result<(), String> {
    let mut rest = line;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| format!("an unclosed `{{{{` in {line:?}"))?;
        let expr = after[..end].trim();
        let swizzle = |f: &str, names: &[&str]| -> Result<Option<String>, String> {
            match expr.strip_prefix(f).and_then(|e| e.strip_suffix(')')) {
                Some(inner) => {
                    let i = eval(inner, env)?;
                    names
                        .get(i as usize)
                        .map(|s| Some(s.to_string()))
                        .ok_or_else(|| format!("{f}{inner}) out of range"))
                }
                None => Ok(None),
            }
        };
        if let Some(s) = swizzle("swz4(", &["x", "y", "z", "w"])? {
            out.push_str(&s);
        } else if let Some(s) = swizzle("swz2(", &["xy", "zw"])? {
            out.push_str(&s);
        } else if let Some(s) = swizzle("bool(", &["false", "true"])? {
            out.push_str(&s);
        } else {
            out.push_str(&eval(expr, env)?.to_string());
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(())
}

fn condition(c: &str, env: &[(String, i64)]) -> Result<bool, String> {
    for op in ["==", "!=", "<=", ">=", "<", ">"] {
        if let Some((a, b)) = c.split_once(op) {
            let (a, b) = (eval(a, env)?, eval(b, env)?);
            return Ok(match op {
                "==" => a == b,
                "!=" => a != b,
                "<=" => a <= b,
                ">=" => a >= b,
                "<" => a < b,
                _ => a > b,
            });
        }
    }
    Ok(eval(c, env)? != 0)
}

/// Integer arithmetic: `+ - * / %`, parentheses, numbers and names.
fn eval(expr: &str, env: &[(String, i64)]) -> Result<i64, String> {
    let tokens = tokenize(expr)?;
    let mut at = 0;
    let v = sum(&tokens, &mut at, env)?;
    if at != tokens.len() {
        return Err(format!("trailing input in {expr:?}"));
    }
    Ok(v)
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(i64),
    Name(String),
    Op(char),
}

fn tokenize(expr: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let cs: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < cs.len() && cs[i].is_ascii_digit() {
                i += 1;
            }
            let s: String = cs[start..i].iter().collect();
            out.push(Tok::Num(s.parse().map_err(|e| format!("{s}: {e}"))?));
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < cs.len() && (cs[i].is_ascii_alphanumeric() || cs[i] == '_') {
                i += 1;
            }
            out.push(Tok::Name(cs[start..i].iter().collect()));
        } else if "+-*/%()".contains(c) {
            out.push(Tok::Op(c));
            i += 1;
        } else {
            return Err(format!("unexpected {c:?} in {expr:?}"));
        }
    }
    Ok(out)
}

fn sum(t: &[Tok], at: &mut usize, env: &[(String, i64)]) -> Result<i64, String> {
    let mut v = product(t, at, env)?;
    while let Some(Tok::Op(op @ ('+' | '-'))) = t.get(*at) {
        *at += 1;
        let r = product(t, at, env)?;
        v = if *op == '+' { v + r } else { v - r };
    }
    Ok(v)
}

fn product(t: &[Tok], at: &mut usize, env: &[(String, i64)]) -> Result<i64, String> {
    let mut v = atom(t, at, env)?;
    while let Some(Tok::Op(op @ ('*' | '/' | '%'))) = t.get(*at) {
        *at += 1;
        let r = atom(t, at, env)?;
        v = match op {
            '*' => v * r,
            _ if r == 0 => return Err("division by zero".into()),
            '/' => v / r,
            _ => v % r,
        };
    }
    Ok(v)
}

fn atom(t: &[Tok], at: &mut usize, env: &[(String, i64)]) -> Result<i64, String> {
    let tok = t.get(*at).cloned();
    *at += 1;
    match tok {
        Some(Tok::Num(n)) => Ok(n),
        Some(Tok::Name(n)) => env
            .iter()
            .rev()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| *v)
            .ok_or_else(|| format!("unknown name {n:?}")),
        Some(Tok::Op('(')) => {
            let v = sum(t, at, env)?;
            match t.get(*at) {
                Some(Tok::Op(')')) => {
                    *at += 1;
                    Ok(v)
                }
                _ => Err("a `(` without its `)`".into()),
            }
        }
        other => Err(format!("expected a value, found {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::expand;

    #[test]
    fn loops_conditions_and_arithmetic() {
        let t = "//# a comment\n//#for i in 0..n\n  a{{i * 2 + 1}} {{swz4(i % 4)}}\n//#if i == 1\n  one\n//#elif i > 1\n  more\n//#else\n  zero\n//#end\n//#end\nend {{(n + 1) * 2}}\n";
        assert_eq!(
            expand(t, &[("n", 3)]).unwrap(),
            "  a1 x\n  zero\n  a3 y\n  one\n  a5 z\n  more\nend 8\n"
        );
    }

    #[test]
    fn mistakes_are_errors_not_panics() {
        for bad in [
            "//#for i in 0..n\nx\n",
            "//#end\n",
            "//#if 1\nx\n",
            "{{nope}}\n",
            "{{1 / 0}}\n",
            "{{(1 + 2}}\n",
            "{{1 +}}\n",
            "{{swz4(9)}}\n",
            "{{bool(2)}}\n",
            "{{1\n",
            "//#for i 0..3\n//#end\n",
        ] {
            assert!(expand(bad, &[("n", 2)]).is_err(), "{bad:?}");
        }
    }

    /// Every template of `shaders/templates/` expands at a shape's values
    /// to WGSL with no template syntax left, and each of its names is
    /// needed (dropping one is an error).
    #[test]
    fn every_template_expands_and_needs_its_names() {
        use crate::gpu::{compose, kernels, mla};
        let cases: [(&str, &str, &[(&str, i64)]); 4] = [
            (
                "constants",
                compose::CONSTANTS_TEMPLATE,
                &[
                    ("head_dim4", 32),
                    ("group", 4),
                    ("block_size", 16),
                    ("qtile", 1),
                    ("paged", 1),
                    ("ht", 4),
                    ("htiles", 1),
                    ("lpt", 8),
                    ("jn", 4),
                    ("subgroups", 0),
                ],
            ),
            (
                "mla_constants",
                mla::MLA_CONSTANTS_TEMPLATE,
                &[
                    ("r4", 144),
                    ("v4", 128),
                    ("block_size", 64),
                    ("hg", 8),
                    ("lanes", 16),
                    ("wg", 128),
                    ("tile_rows", 4),
                    ("qn", 9),
                    ("an", 8),
                ],
            ),
            (
                "lanes_rows",
                kernels::lanes::ROWS_TEMPLATE,
                &[("ht", 3), ("shuffle", 1)],
            ),
            (
                "rows_layout",
                kernels::rows::LAYOUT_TEMPLATE,
                &[("rows", 8), ("tg", 4), ("wgs", 128), ("subgroups", 1)],
            ),
        ];
        for (name, t, vars) in cases {
            let out = expand(t, vars).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!out.contains("{{") && !out.contains("//#"), "{name}: {out}");
            for skip in 0..vars.len() {
                let fewer: Vec<(&str, i64)> = vars
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != skip)
                    .map(|(_, v)| *v)
                    .collect();
                assert!(
                    expand(t, &fewer).is_err(),
                    "{name} does not use `{}`",
                    vars[skip].0
                );
            }
        }
    }
}
