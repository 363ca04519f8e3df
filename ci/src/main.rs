//! emm's CI entry points that are more than a list of cargo commands.
//!
//! - `cargo run -p ci -- gpu-bundle [DIR]` builds the release test binaries and examples and
//!   assembles DIR (default `gpu-bundle/`): `bin/` with the stripped executables and their
//!   list (`bin/MANIFEST`), and `run-gpu.sh`, the one command the GPU machine runs (it needs
//!   no Rust toolchain; its Python half needs a checkout and `wheels/`, which the GPU
//!   workflow's bundle job adds: `.github/workflows/gpu.yml`). The
//!   bundle is self-contained: the tests that read the repository's files (the sources' layer
//!   check, the trace corpus's replays on the simulator) are left out; `.ci/run` runs them.
//!
//! - `cargo run -p ci -- doc-figures [--check]` writes docs/testing.md's account of the fault
//!   sweep (between its `<!-- figures: fault-sweep` markers) from the figures the sweep's last run
//!   left in the target directory; with `--check` it changes nothing and fails when the page
//!   differs, which `.ci/run` does after the tests.
//!
//! The CPU job is `.ci/run` (fmt, clippy, tests, loom models).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("gpu-bundle") => {
            gpu_bundle(Path::new(args.get(1).map_or("gpu-bundle", String::as_str)))
        }
        Some("doc-figures") => doc_figures(args.get(1).map(String::as_str) == Some("--check")),
        _ => Err("usage: cargo run -p ci -- gpu-bundle [DIR] | doc-figures [--check]".to_owned()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ci: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a cargo build with `--message-format=json` and returns (target name, kind, executable)
/// for every executable it produced.
fn cargo_executables(args: &[&str]) -> Result<Vec<(String, String, PathBuf)>, String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo {} failed", args.join(" ")));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut found = Vec::new();
    for line in text
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
    {
        let (Some(exe), Some(name), Some(kind)) = (
            json_str(line, "\"executable\":"),
            json_str(line, "\"name\":"),
            json_str(line, "\"kind\":["),
        ) else {
            continue;
        };
        found.push((name, kind, PathBuf::from(exe)));
    }
    Ok(found)
}

/// The string value after `key` in one line of cargo's JSON (cargo escapes nothing in the
/// paths and names this reads).
fn json_str(line: &str, key: &str) -> Option<String> {
    let rest = &line[line.find(key)? + key.len()..];
    let rest = rest.strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_owned())
}

fn gpu_bundle(dir: &Path) -> Result<(), String> {
    let bin = dir.join("bin");
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| format!("clearing {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&bin).map_err(|e| format!("creating {}: {e}", bin.display()))?;
    let mut exes = cargo_executables(&["test", "--release", "--workspace", "--no-run"])?;
    exes.extend(cargo_executables(&[
        "build",
        "--release",
        "-p",
        "integration",
        "--examples",
    ])?);
    let mut copied = Vec::new();
    for (name, kind, path) in exes {
        let file = match (kind.as_str(), name.as_str()) {
            // Checks of the repository's files, not of the GPU: they run in `.ci/run`, and
            // the bundle carries no sources or traces.
            ("test", "source_checks" | "traces") => continue,
            ("test", "suite") => "suite".to_owned(),
            ("example", _) => name.clone(),
            // A library's unit tests: an `rlib`'s, or the Python crate's (`cdylib` first).
            ("lib" | "cdylib" | "rlib", _) => format!("unit-{name}"),
            ("test", _) => format!("test-{name}"),
            _ => continue,
        };
        if copied
            .iter()
            .any(|c: &String| c.split(' ').next() == Some(file.as_str()))
        {
            continue;
        }
        let dest = bin.join(&file);
        std::fs::copy(&path, &dest).map_err(|e| format!("copying {}: {e}", path.display()))?;
        let stripped = Command::new("strip")
            .arg(&dest)
            .status()
            .is_ok_and(|s| s.success());
        copied.push(format!(
            "{file}{}",
            if stripped { "" } else { " (not stripped)" }
        ));
    }
    for script in ["run-gpu.sh", "bench-gpu.sh", "bench_peers.py"] {
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("gpu")
                .join(script),
            dir.join(script),
        )
        .map_err(|e| format!("copying {script}: {e}"))?;
    }
    if !copied.iter().any(|c| c.starts_with("suite")) {
        return Err("the integration suite binary was not built".into());
    }
    // What run-gpu.sh must find: every binary copied, one a line. A bundle whose binaries went
    // missing on the way fails the job by name instead of running less.
    let manifest: String = copied
        .iter()
        .filter_map(|c| c.split(' ').next())
        .map(|name| format!("{name}\n"))
        .collect();
    std::fs::write(bin.join("MANIFEST"), manifest)
        .map_err(|e| format!("writing {}: {e}", bin.join("MANIFEST").display()))?;
    println!("bundle {}: {}", dir.display(), copied.join(", "));
    println!("on the GPU machine: bash {}/run-gpu.sh", dir.display());
    Ok(())
}

/// The page that holds the generated account of the fault sweep.
const FIGURES_PAGE: &str = "docs/testing.md";

/// Where the page's generated account of the fault sweep begins and ends.
const FIGURES_BEGIN: &str = "<!-- figures: fault-sweep";
const FIGURES_END: &str = "<!-- /figures -->";

/// The fault-sweep account of [`FIGURES_PAGE`], from the figures the sweep's three tests
/// wrote; written into the page, or with `check` compared with it.
fn doc_figures(check: bool) -> Result<(), String> {
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let dir = Path::new(&target).join("tmp/fault_sweep_figures");
    let mut figures = std::collections::BTreeMap::new();
    for test in ["single", "pairs", "teardown"] {
        let path = dir.join(format!("{test}.txt"));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            format!(
                "reading {}: {e}; run the fault sweep first (cargo test -p integration --test fault_sweep)",
                path.display()
            )
        })?;
        for line in text.lines() {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("{}: a line without '=': {line}", path.display()))?;
            figures.insert(k.to_owned(), v.to_owned());
        }
    }
    let get = |k: &str| {
        figures
            .get(k)
            .cloned()
            .ok_or_else(|| format!("the sweep's figures lack {k}; run the fault sweep again"))
    };
    let configurations = get("configurations")?;
    let count = configurations.split(", ").count();
    let body = format!(
        "{FIGURES_BEGIN} (written by `cargo run -p ci -- doc-figures` from the sweep's last \
         run; `.ci/run` checks it) -->\n  \
         The last run injected {} single faults ({} error kinds at every call) in {count} \
         configurations ({configurations}), {} runs with a second fault, and {} faulted \
         teardowns. The operations emm never calls, which no workload of emm's can fault: \
         {}.\n  {FIGURES_END}",
        grouped(&get("single_faults")?),
        get("error_kinds")?,
        grouped(&get("pair_runs")?),
        grouped(&get("teardown_runs")?),
        get("never_called")?,
    );
    let page = std::fs::read_to_string(FIGURES_PAGE)
        .map_err(|e| format!("reading {FIGURES_PAGE}: {e}"))?;
    let (Some(start), Some(end)) = (page.find(FIGURES_BEGIN), page.find(FIGURES_END)) else {
        return Err(format!(
            "{FIGURES_PAGE} has no {FIGURES_BEGIN} ... {FIGURES_END} section"
        ));
    };
    let current = &page[start..end + FIGURES_END.len()];
    if current == body {
        return Ok(());
    }
    if check {
        return Err(format!(
            "{FIGURES_PAGE}'s fault-sweep figures differ from the sweep's run; run `cargo run -p \
             ci -- doc-figures` and commit {FIGURES_PAGE}.\nthe page says:\n{current}\nthe run \
             says:\n{body}"
        ));
    }
    let updated = format!(
        "{}{body}{}",
        &page[..start],
        &page[end + FIGURES_END.len()..]
    );
    std::fs::write(FIGURES_PAGE, updated).map_err(|e| format!("writing {FIGURES_PAGE}: {e}"))
}

/// `1234567` as `1 234 567`, as the docs write numbers.
fn grouped(digits: &str) -> String {
    let n = digits.len();
    let mut out = String::with_capacity(n + n / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (n - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}
