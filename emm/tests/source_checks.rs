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
];

fn layer_of(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

/// The top-level module a file under `src` belongs to (`None` for `lib.rs`, the root).
fn module_of(relative: &Path) -> Option<String> {
    let first = relative
        .components()
        .next()?
        .as_os_str()
        .to_str()?
        .to_owned();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_owned();
    (name != "lib").then_some(name)
}

/// The violations in one file's text, as `line: what`.
fn check_source(module: &str, text: &str) -> Vec<String> {
    let Some(own) = layer_of(module) else {
        return vec![format!(
            "module `{module}` has no layer: add it to LAYERS in emm/tests/layers.rs and to ARCHITECTURE.md"
        )];
    };
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let code = code.split(" //").next().unwrap_or(code);
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            // `$crate::` in macros and `some_crate::` are not this crate.
            let before = &rest[..i];
            let ident: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            rest = &after[ident.len()..];
            if before.ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            if ident.is_empty() {
                found.push(format!(
                    "{}: `crate::{{..}}` groups several layers in one path; import each layer's items by its module",
                    n + 1
                ));
                continue;
            }
            match layer_of(&ident) {
                Some(l) if l <= own => {}
                Some(l) => found.push(format!(
                    "{}: `{module}` (layer {own}) imports `crate::{ident}` (layer {l}), a higher layer",
                    n + 1
                )),
                None if ident == "driver_sys" => {}
                None => found.push(format!(
                    "{}: `crate::{ident}` is not a layer's module (a root re-export hides which layer it comes from); use its module path",
                    n + 1
                )),
            }
        }
    }
    found
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
        let Some(module) = module_of(relative) else {
            continue;
        };
        modules.insert(module.clone());
        let text = std::fs::read_to_string(file).expect("source is UTF-8");
        let found = check_source(&module, &text);
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

#[test]
fn the_check_sees_upward_root_and_grouped_imports() {
    let upward = "use crate::runtime::context::Context;\n";
    assert_eq!(check_source("memory", upward).len(), 1);
    let root = "use crate::MemoryPointer;\n";
    assert_eq!(check_source("runtime", root).len(), 1);
    let grouped = "use crate::{EmmError, Runtime};\n";
    assert_eq!(check_source("contract", grouped).len(), 1);
    let inline = "    let x = crate::managers::pool::PoolAllocator::factory();\n";
    assert_eq!(check_source("host", inline).len(), 1);
    let fine = "use crate::memory::pointer::MemoryPointer; // crate::runtime in a comment\n\
                /// [`Context`](crate::Context) in a doc link\n\
                use driver_sys::DevicePtr;\n";
    assert!(check_source("contract", fine).is_empty());
    assert_eq!(check_source("newthing", fine).len(), 1);
}
