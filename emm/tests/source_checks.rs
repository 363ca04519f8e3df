//! emm's layers point one way: a module may import from its own layer and the layers below,
//! never from one above (ARCHITECTURE.md). This test reads every source file of the crate and
//! fails on an upward `crate::` path, on a path through a crate-root re-export (which hides
//! the layer it comes from), and on a module it does not know (add new modules to `LAYERS`).
//!
//! A check of the sources, not of behaviour: it runs with the workspace's tests (`.ci/run`),
//! and the GPU bundle leaves it out, since the bundle carries no sources.
#![cfg(not(emm_loom))]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every top-level module of `emm/src`, by layer, bottom first.
const LAYERS: &[(&str, u32)] = &[
    ("clock", 0),
    ("error", 0),
    ("sync", 0),
    ("size_class", 0),
    ("slab", 0),
    ("lines", 0),
    ("test_config", 0),
    ("thread_slots", 0),
    ("units", 0),
    ("memory", 1),
    ("contract", 2),
    ("host", 3),
    ("managers", 4),
    ("adaptors", 4),
    ("ipc", 5),
    ("objects", 5),
    ("resources", 5),
    ("runtime", 6),
    ("replay", 7),
    // Test code of the loom build, over the public API.
    ("loom_models", 8),
];

fn layer_of(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

/// The module path of a file under `src` (`managers/pool/mod.rs` and `managers/pool.rs`:
/// `["managers", "pool"]`; empty for `lib.rs`, the root).
fn module_path_of(relative: &Path) -> Vec<String> {
    let mut path: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if let Some(last) = path.pop() {
        let stem = last.strip_suffix(".rs").unwrap_or(&last).to_owned();
        if stem != "mod" && stem != "lib" {
            path.push(stem);
        }
    }
    path
}

/// `text` with comments, string literals and character literals blanked out (replaced by
/// spaces, lines kept), so that paths in them, and braces in format strings, are not code.
fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, b: u8| out.push(if b == b'\n' { '\n' } else { ' ' });
    while i < bytes.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').map_or(bytes.len(), |e| i + e);
            out.extend(std::iter::repeat_n(' ', end - i));
            i = end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(bytes.len(), |e| i + e + 2);
            for &b in &bytes[i..end] {
                blank(&mut out, b);
            }
            i = end;
        } else if let Some(hashes) = raw_string_start(rest) {
            // r"..." or r#"..."#: ends at the quote followed by as many hashes.
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes;
            let end = text[body..]
                .find(&close)
                .map_or(bytes.len(), |e| body + e + close.len());
            for &b in &bytes[i..end] {
                blank(&mut out, b);
            }
            i = end;
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(bytes.len());
            for &b in &bytes[i..end] {
                blank(&mut out, b);
            }
            i = end;
        } else if bytes[i] == b'\'' && char_literal_len(rest).is_some() {
            let len = char_literal_len(rest).unwrap_or(1);
            out.extend(std::iter::repeat_n(' ', len));
            i += len;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The number of `#`s of a raw string literal that starts `rest` (`None`: not one).
fn raw_string_start(rest: &str) -> Option<usize> {
    let after = rest.strip_prefix('r')?;
    let hashes = after.chars().take_while(|&c| c == '#').count();
    after[hashes..].starts_with('"').then_some(hashes)
}

/// The length of a character literal (`'a'`, `'\n'`, `'{'`) at the start of `rest`; `None`
/// for a lifetime (`'a`).
fn char_literal_len(rest: &str) -> Option<usize> {
    let mut chars = rest.char_indices().skip(1);
    let (_, first) = chars.next()?;
    if first == '\\' {
        // An escape: up to the closing quote.
        return rest[1..].find('\'').map(|e| e + 2).filter(|&e| e > 2);
    }
    let (at, second) = chars.next()?;
    (second == '\'').then_some(at + 1)
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The violations in one file's text, as `line: what`; `path` is the file's module path.
fn check_source(path: &[String], text: &str) -> Vec<String> {
    let Some(own_module) = path.first() else {
        return Vec::new(); // the root re-exports every layer
    };
    let Some(own) = layer_of(own_module) else {
        return vec![format!(
            "module `{own_module}` has no layer: add it to LAYERS in emm/tests/source_checks.rs and to ARCHITECTURE.md"
        )];
    };
    let mut found = Vec::new();
    let code = code_only(text);
    // The inline modules (`mod tests { .. }`) the scan is in, with the brace depth each
    // closes at: `super::` inside one names the file's module.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    for (n, line) in code.lines().enumerate() {
        let line_no = n + 1;
        let mut current: Vec<String> = path.to_vec();
        current.extend(inline.iter().map(|(m, _)| m.clone()));
        for target in paths_in(line, &current) {
            match target {
                Err(what) => found.push(format!("{line_no}: {what}")),
                Ok(first) => match layer_of(&first) {
                    Some(l) if l <= own => {}
                    Some(l) => found.push(format!(
                        "{line_no}: `{own_module}` (layer {own}) imports `{first}` (layer {l}), a higher layer"
                    )),
                    None if first == "driver_sys" => {}
                    None => found.push(format!(
                        "{line_no}: `crate::{first}` is not a layer's module (a root re-export hides which layer it comes from); use its module path"
                    )),
                },
            }
        }
        // Inline modules opened and closed on this line: `mod name {` opens one at its brace.
        let words: Vec<(usize, &str)> = line.match_indices(|c: char| is_ident(c)).fold(
            Vec::new(),
            |mut words: Vec<(usize, &str)>, (at, _)| {
                match words.last_mut() {
                    Some((start, word)) if *start + word.len() == at => {
                        *word = &line[*start..at + 1];
                    }
                    _ => words.push((at, &line[at..at + 1])),
                }
                words
            },
        );
        let opens_at = words.windows(2).find(|w| w[0].1 == "mod").and_then(|w| {
            let after = w[1].0 + w[1].1.len();
            let brace = after + line[after..].find('{')?;
            line[after..brace]
                .trim()
                .is_empty()
                .then(|| (brace, w[1].1.to_owned()))
        });
        for (at, c) in line.char_indices() {
            match c {
                '{' => {
                    if let Some((brace, name)) = &opens_at
                        && *brace == at
                    {
                        inline.push((name.clone(), depth));
                    }
                    depth += 1;
                }
                '}' => {
                    depth = depth.saturating_sub(1);
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                }
                _ => {}
            }
        }
    }
    found
}

/// The crate-level module each path on `line` (code only) reaches: the first segment after
/// `crate::` or `$crate::`, or what a chain of `super::` resolves to from `current` (the
/// module path the line is in). An error names a path that reaches the root's re-exports
/// (a group, a glob, or an item), or climbs above it.
fn paths_in(line: &str, current: &[String]) -> Vec<Result<String, String>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < line.len() {
        let rest = &line[i..];
        let before = line[..i].chars().next_back();
        let starts_word = !before.is_some_and(|c| is_ident(c) || c == ':');
        let (base, after): (Vec<String>, &str) = if starts_word && rest.starts_with("crate::") {
            (Vec::new(), &rest["crate::".len()..])
        } else if before != Some('$') && starts_word && rest.starts_with("super::") {
            let mut supers = 0;
            let mut tail = rest;
            while let Some(t) = tail.strip_prefix("super::") {
                supers += 1;
                tail = t;
            }
            if supers > current.len() {
                out.push(Err(format!(
                    "`{}` climbs above the crate root",
                    "super::".repeat(supers)
                )));
                i += rest.len() - tail.len();
                continue;
            }
            (current[..current.len() - supers].to_vec(), tail)
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        // `$crate::` reaches the crate root as `crate::` does.
        let ident: String = after.chars().take_while(|&c| is_ident(c)).collect();
        i += rest.len() - after.len() + ident.len();
        match base.first() {
            Some(first) => out.push(Ok(first.clone())),
            None if ident.is_empty() => out.push(Err(
                "`crate::{..}` (or a glob of the root) groups several layers in one path; import each layer's items by its module"
                    .to_owned(),
            )),
            None => out.push(Ok(ident)),
        }
    }
    out
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("emm/src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_layer_imports_a_higher_one() {
    // Where emm's sources are: beside the manifest this test was built from, or (a copy of the
    // repository on another machine, such as the GPU job's) under the working directory.
    let candidates = [
        Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        PathBuf::from("emm/src"),
    ];
    let src = candidates
        .iter()
        .find(|p| p.join("lib.rs").is_file())
        .unwrap_or_else(|| {
            panic!(
                "emm's sources are not at {candidates:?}: run this test from the repository's \
                 root (it reads the sources to check their imports)"
            )
        })
        .clone();
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut violations: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut modules = std::collections::BTreeSet::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let path = module_path_of(relative);
        let Some(module) = path.first() else {
            continue;
        };
        modules.insert(module.clone());
        let text = std::fs::read_to_string(file).expect("source is UTF-8");
        let found = check_source(&path, &text);
        if !found.is_empty() {
            violations.insert(relative.display().to_string(), found);
        }
    }
    assert!(
        violations.is_empty(),
        "imports against the layers:\n{violations:#?}"
    );
    for (m, _) in LAYERS {
        assert!(
            modules.contains(*m),
            "LAYERS names `{m}`, which emm/src no longer has: remove it"
        );
    }
}

/// A module path from its `::`-separated spelling.
fn at(path: &str) -> Vec<String> {
    path.split("::").map(str::to_owned).collect()
}

#[test]
fn the_check_sees_upward_root_and_grouped_imports() {
    let upward = "use crate::runtime::context::Context;\n";
    assert_eq!(check_source(&at("memory"), upward).len(), 1);
    let root = "use crate::MemoryPointer;\n";
    assert_eq!(check_source(&at("runtime"), root).len(), 1);
    let grouped = "use crate::{EmmError, Runtime};\n";
    assert_eq!(check_source(&at("contract"), grouped).len(), 1);
    let inline = "    let x = crate::managers::pool::PoolAllocator::factory();\n";
    assert_eq!(check_source(&at("host"), inline).len(), 1);
    let fine = "use crate::memory::pointer::MemoryPointer; // crate::runtime in a comment\n\
                /// [`Context`](crate::Context) in a doc link\n\
                let s = \"crate::runtime in a string {\";\n\
                use driver_sys::DevicePtr;\n";
    assert!(check_source(&at("contract"), fine).is_empty());
    assert_eq!(check_source(&at("newthing"), fine).len(), 1);
}

#[test]
fn the_check_resolves_super_chains_and_dollar_crate() {
    // From a root module, `super::` is the root: its next segment is a layer.
    let up = "use super::runtime::Context;\n";
    assert_eq!(check_source(&at("memory"), up).len(), 1);
    assert!(check_source(&at("replay"), up).is_empty());
    // Two levels up from memory::pointer::parts is the root.
    let up2 = "use super::super::super::runtime::Context;\n";
    assert_eq!(check_source(&at("memory::pointer::parts"), up2).len(), 1);
    // Within a layer's own tree, `super::` stays there.
    let sibling = "use super::arena::Arena;\nuse super::super::pool::PoolConfig;\n";
    assert!(check_source(&at("managers::pool::streams"), sibling).is_empty());
    // A macro's `$crate::` path is checked as `crate::` is.
    let dollar = "macro_rules! m { () => { $crate::runtime::Runtime::new() } }\n";
    assert_eq!(check_source(&at("error"), dollar).len(), 1);
    // `use super::*` in a file's inline test module names the file's own module; in the root
    // module's file, a glob of the root is refused.
    let tests = "pub fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    fn g() { let s = \"}\"; }\n}\nuse super::*;\n";
    let found = check_source(&at("error"), tests);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("7:"), "{found:?}");
    // Climbing above the root is reported.
    assert_eq!(
        check_source(&at("memory"), "use super::super::x;\n").len(),
        1
    );
    // A module opened and closed on one line ends there.
    let one_line = "mod a { fn f() {} }\nuse super::runtime::X;\n";
    assert_eq!(check_source(&at("memory"), one_line).len(), 1);
    // Characters and lifetimes: a `'{'` is not a brace, `'a` is not a character.
    let chars = "fn f<'a>(x: &'a str) -> char { '{' }\nmod t {\n use super::*;\n}\n";
    assert!(
        check_source(&at("sync"), chars).is_empty(),
        "{:?}",
        check_source(&at("sync"), chars)
    );
}

/// The file at `relative` under the repository (beside emm's manifest, or under the working
/// directory on a machine that has a copy of the repository), read whole.
fn repository_file(relative: &str) -> String {
    let candidates = [
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(relative),
        PathBuf::from(relative),
    ];
    let found = candidates.iter().find(|p| p.is_file()).unwrap_or_else(|| {
        panic!("{relative} is not at {candidates:?}: run this test from the repository's root")
    });
    std::fs::read_to_string(found).expect("readable")
}

/// The docs that list the layers name every module of `LAYERS` (lib.rs's table and
/// ARCHITECTURE.md's diagram), so that a module added to the check is added to them too.
#[test]
fn the_layer_lists_of_the_docs_name_every_module() {
    let lib = repository_file("emm/src/lib.rs");
    let table: String = lib
        .lines()
        .filter(|l| {
            l.strip_prefix("//! | ")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let architecture = repository_file("ARCHITECTURE.md");
    let diagram = architecture
        .split("## emm in layers")
        .nth(1)
        .and_then(|s| s.split("```").nth(1))
        .expect("ARCHITECTURE.md has its layer diagram under \"## emm in layers\"");
    let mut missing = Vec::new();
    for (module, _) in LAYERS {
        if !table.contains(&format!("`{module}`")) {
            missing.push(format!("emm/src/lib.rs's layer table lacks `{module}`"));
        }
        let named = diagram
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| w == *module);
        if !named {
            missing.push(format!("ARCHITECTURE.md's layer diagram lacks {module}"));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// The behaviour binary's module table (its `main.rs`) has a row for every module it declares.
#[test]
fn the_behaviour_binarys_table_lists_every_module() {
    let main = repository_file("emm/tests/behaviour/main.rs");
    let missing: Vec<&str> = main
        .lines()
        .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
        .filter(|m| *m != "common")
        .filter(|m| !main.contains(&format!("//! | `{m}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "emm/tests/behaviour/main.rs's module table lacks {missing:?}: add a row saying what each proves"
    );
}

/// The std primitives loom cannot see: atomics and locks.
const STD_SYNC: [&str; 4] = [
    "std::sync::atomic",
    "std::sync::Mutex",
    "std::sync::RwLock",
    "std::sync::Condvar",
];

/// The lines of `text` that name one of [`STD_SYNC`] in code (but for `Ordering` alone) without
/// a reason that mentions loom on the line or in the five lines before (a static, which loom's
/// types cannot be). Tests inside the file (after `#[cfg(...test...)]`) are left out.
fn unshimmed_sync(text: &str) -> Vec<String> {
    let code = code_only(text);
    let (raw, code): (Vec<&str>, Vec<&str>) = (text.lines().collect(), code.lines().collect());
    let mut found = Vec::new();
    for (i, line) in code.iter().enumerate() {
        if raw[i].trim_start().starts_with("#[cfg(") && raw[i].contains("test") {
            break;
        }
        let grouped = line.contains("std::sync::{")
            && ["Mutex", "RwLock", "Condvar", "atomic"]
                .iter()
                .any(|t| line.contains(t));
        let named = STD_SYNC.iter().any(|p| {
            line.match_indices(p)
                .any(|(at, _)| !line[at..].starts_with("std::sync::atomic::Ordering"))
        });
        if !grouped && !named {
            continue;
        }
        let reason = raw[i.saturating_sub(5)..=i]
            .iter()
            .any(|l| l.contains("//") && l.to_ascii_lowercase().contains("loom"));
        if !reason {
            found.push(format!("line {}: {}", i + 1, raw[i].trim()));
        }
    }
    found
}

/// emm's atomics and locks come from the loom shim (`sync.rs`), so that the loom models see
/// them; a std one outside it says why on its line or just above (a `static`, which loom's
/// types cannot be).
#[test]
fn atomics_and_locks_stay_behind_the_loom_shim() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if !src.join("lib.rs").is_file() {
        // A copy of the test binary away from its sources (the GPU bundle): the layer test
        // above says where to run it; this one has nothing to read.
        return;
    }
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut violations = BTreeMap::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        if matches!(relative.to_str(), Some("sync.rs" | "loom_models.rs")) {
            continue;
        }
        let found = unshimmed_sync(&std::fs::read_to_string(file).expect("source is UTF-8"));
        if !found.is_empty() {
            violations.insert(relative.display().to_string(), found);
        }
    }
    assert!(
        violations.is_empty(),
        "std atomics or locks outside the loom shim (use crate::sync's, or say on the line or \
         just above why loom cannot have it):\n{violations:#?}"
    );
}

#[test]
fn the_sync_check_wants_a_reason() {
    let bare = "use std::sync::atomic::AtomicU64;\n";
    assert_eq!(unshimmed_sync(bare).len(), 1);
    let grouped = "use std::sync::{Arc, Mutex};\n";
    assert_eq!(unshimmed_sync(grouped).len(), 1);
    let ordering = "fn f() { N.load(std::sync::atomic::Ordering::Relaxed); }\n";
    assert!(unshimmed_sync(ordering).is_empty());
    let reasoned = "// A static, so std's atomic (loom's cannot be one).\nstatic N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);\n";
    assert!(unshimmed_sync(reasoned).is_empty());
    let in_tests =
        "fn f() {}\n#[cfg(all(test, not(emm_loom)))]\nmod tests {\n    use std::sync::Mutex;\n}\n";
    assert!(unshimmed_sync(in_tests).is_empty());
}
