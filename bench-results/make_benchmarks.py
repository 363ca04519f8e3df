"""Writes BENCHMARKS.md (and the plot beside it) from one GPU run's files: the page is made
here, never edited by hand.

    python3 bench-results/make_benchmarks.py bench-results/run-2026-11-29-h200-7e31f4d \
        [--programs DIR] [--rounds DIR] [--logged DIR] [--host DIR] [--sleep DIR]

The run directory holds `run.txt` (machine, date, commit, the calls made), `bench-full.csv`
and `bench-quick.csv` (bench_gpu: section,subject,param,threads,value,unit), `peers.csv`
(bench_peers.py), `python.jsonl` (python/bench/bench_alloc.py), `corpus-frameworks.jsonl`
(integration/traces/record/replay_frameworks.py), `corpus-emm.csv` (the replay example) and,
where the run has it, `training.jsonl` (compare_training.py's rounds).
Every table puts emm beside its anchor from the same run, with the ratio and the target from
`shared/docs/performance.md`.

With `--host DIR`, the host-side figures of a later run of bench_gpu (`pairs.csv`: the pair
section of each build it compared, `build,round,` before the usual columns, the build `head`
being the commit named; `host.csv`: the `live` and `overhead` sections; `run.txt`) replace the
main run's pair table and target and add the history ring's cost, the pair beside many live
blocks and the random workload's memory overhead.

With `--programs DIR`, the memory section comes from a run of the real programs on the GPU
(`ci/gpu/run-programs.sh`: `run.txt`, `programs.jsonl`, and where the run logged programs,
`programs-logged.jsonl` with `replay-sim.csv`, their logs replayed on the simulator) in place
of the trace replays of the main run. Its `step-rounds.jsonl`, where present, holds a later
call's rounds of some programs under PyTorch and emm's pools in turn (`programs.py --rounds N`,
described by `run.txt`'s `step_rounds` line): those programs' steps are the fastest round's,
compared with PyTorch's by the median of each round's ratio to PyTorch's in the same round, and
the table marks them.

With `--rounds DIR` (once or more), those rounds come from run folders of their own (each its
`step-rounds.jsonl` and `run.txt`) instead of `--programs`'s, their rounds pooled: a ratio is
always taken within one round of one folder. The table's note gives each ratio's spread over
the rounds, a 90 % bootstrap interval of its median, and the held memory the rounds saw; where
the rounds also ran PyTorch over the driver's stream-ordered pool (`torch-async`, `torch-floor`)
the note gives their ratios, and a folder's `torch-c-loop.jsonl` (python/bench/torch_c_loop.py)
the cost of a pair of emm.torch's C functions and of the floor's.

With `--logged DIR` (once or more), the replay of logged programs against their GPU runs comes
from later runs of their own (`run.txt`, `programs-logged.jsonl`, `replay-sim.csv`) instead of
`--programs`'s; with several, each row names its run's commit.

With `--sleep DIR`, a section on `vmm-pool`'s sleep and wake comes from a run of
`python/bench/sleep_handoff.py` (`run.txt`, `handoff.json`).
"""

import csv
import json
import math
import os
import random
import statistics
import sys

args = sys.argv[1:]
host_run = None
if "--host" in args:
    k = args.index("--host")
    host_run = args[k + 1].rstrip("/")
    del args[k:k + 2]
programs_run = None
if "--programs" in args:
    k = args.index("--programs")
    programs_run = args[k + 1].rstrip("/")
    del args[k:k + 2]
logged_runs = []
while "--logged" in args:
    k = args.index("--logged")
    logged_runs.append(args[k + 1].rstrip("/"))
    del args[k:k + 2]
rounds_runs = []
while "--rounds" in args:
    k = args.index("--rounds")
    rounds_runs.append(args[k + 1].rstrip("/"))
    del args[k:k + 2]
sleep_run = None
if "--sleep" in args:
    k = args.index("--sleep")
    sleep_run = args[k + 1].rstrip("/")
    del args[k:k + 2]
run = args[0].rstrip("/")
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rel_run = os.path.relpath(os.path.abspath(run), root)


def median_interval(values, draws=4000):
    """A 90 % bootstrap interval of the median of `values` (resampled with a fixed seed, so
    that the page is the same from one generation to the next)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[draws // 20], medians[draws - 1 - draws // 20]


def run_info(folder):
    """A run folder's `run.txt` (key=value lines) as a dict."""
    return dict(line.rstrip("\n").split("=", 1) for line in open(os.path.join(folder, "run.txt")))


info = run_info(run)


def rows(name):
    path = os.path.join(run, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []


full, quick = rows("bench-full.csv"), rows("bench-quick.csv")
# The pair section the page reports: the host run's `head` build, first round, where given.
host_pairs, host_rows = [], []
if host_run:
    all_pairs = list(csv.DictReader(open(os.path.join(host_run, "pairs.csv"))))
    host_pairs = [r for r in all_pairs if r["build"] == "head" and r["round"] == "1"]
    host_rows = list(csv.DictReader(open(os.path.join(host_run, "host.csv"))))
    hinfo = run_info(host_run)
sinfo = run_info(sleep_run) if sleep_run else {}
pair_src = host_pairs or full
pair_from = "host run" if host_run else "call 1"
peers = list(csv.reader(open(os.path.join(run, "peers.csv"))))


def value(source, section, subject, param=None, threads=None):
    for r in source:
        if r["section"] == section and r["subject"] == subject:
            if param is not None and r["param"] != str(param):
                continue
            if threads is not None and r["threads"] != str(threads):
                continue
            return float(r["value"])
    return None


def size(n):
    n = int(n)
    for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << s and n % (1 << s) == 0:
            return f"{n >> s} {unit}"
    return f"{n} B"


def ns(v):
    if v is None:
        return "-"
    if v >= 10_000:
        return f"{v / 1000:,.1f} µs".replace(",", " ")
    return f"{v:.1f} ns" if v < 100 else f"{v:.0f} ns"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f} ×"


out = []
w = out.append
w("# Benchmarks")
w("")
w("<!-- Generated by bench-results/make_benchmarks.py from a run's files; do not edit. -->")
w("")
w("What each manager costs and holds on a real GPU, every figure beside the anchor a user would")
w("otherwise pick, measured in the same run. Benchmarks, not tests: CI times nothing (it counts")
w("instructions instead, below). Each time is the median of five batches of many operations.")
w("")
w(f"- **Machine:** {info['machine']}.")
w(f"- **Date and commit:** {info['date']}, {info['commit']} (the GPU bundle and wheel built")
w("  here: `cargo run -p ci -- gpu-bundle .gpu/bundle`; `cd python && maturin build --release`).")
w(f"- **Call 1:** {info['call1']}.")
w(f"- **Call 2:** {info['call2']}.")
if "call3" in info:
    w(f"- **Call 3:** {info['call3']}.")


def cite_run(folder, flag, lead, also=()):
    """Writes the header's lines for the run of its own in `folder` (its `run.txt`), under
    `lead`, with the lines `also` names ((key, label) pairs) that the run has. Returns the
    page command's argument."""
    rel = os.path.relpath(os.path.abspath(folder), root)
    i = run_info(folder)
    extra = "".join(f" {label}: {i[key]}." for key, label in also if key in i)
    w(f"- {lead} from a run of its own:")
    w(f"  {i['machine']}; {i['date']}, {i['commit']}: {i['call']}.{extra}")
    w(f"  Files: [`{rel}/`]({rel}/).")
    return f" --{flag} {rel}"


page_args = ""
if programs_run:
    page_args += cite_run(programs_run, "programs",
                          "**Memory held by real programs** (its section and target rows) comes",
                          also=[("step_rounds", "Step rounds")])
for rounds_run in rounds_runs:
    page_args += cite_run(rounds_run, "rounds",
                          "**The step rounds** (the memory table's steps marked †, pooled with "
                          "those of any other such run) come",
                          also=[("step_rounds", "Step rounds")])
for logged_run in logged_runs:
    lead = (f"**The logged programs replayed** (the memory section's last table, its rows of "
            f"{run_info(logged_run)['commit'].split()[0]}) come")
    if logged_run in rounds_runs:
        rel = os.path.relpath(os.path.abspath(logged_run), root)
        w(f"- {lead} from the step rounds' run. Replayed: {run_info(logged_run)['replay']}.")
        page_args += f" --logged {rel}"
    else:
        page_args += cite_run(logged_run, "logged", lead, also=[("replay", "Replayed")])
if host_run:
    rel_host = os.path.relpath(os.path.abspath(host_run), root)
    w("- **Host run** (the pair table and its target, the history ring's cost, pairs beside live")
    w(f"  blocks, the random workload's memory overhead): {hinfo['machine']}; {hinfo['date']},")
    w(f"  {hinfo['commit']}: {hinfo['call']}. Files: [`{rel_host}/`]({rel_host}/).")
    page_args += f" --host {rel_host}"
if sleep_run:
    page_args += cite_run(sleep_run, "sleep", "**Sleep and wake** (its section) comes")
w(f"- **Files:** [`{rel_run}/`]({rel_run}/); this page: `python3 bench-results/make_benchmarks.py {rel_run}{page_args}`.")
w("- The earlier pages' run-by-run record (`HISTORY.md`, `runs.md`) and their runs' files are in")
w("  [`bench-results/archive.tar.xz`](bench-results/archive.tar.xz) (`tar -xJf archive.tar.xz NAME`).")
w("")

# ---- targets summary -------------------------------------------------------------------
sizes = ["256", "4096", "65536", "1048576", "16777216", "268435456", "1073741824"]
pool_small = [value(pair_src, "pair", "pool", s) for s in sizes[:4]]
pool_large = [value(pair_src, "pair", "pool", s) for s in sizes[4:]]
t1 = value(full, "threads", "pool", threads=1)
t8 = value(full, "threads", "pool", threads=8)
t16 = value(full, "threads", "pool", threads=16)
rnd = [float(r["value"]) for r in quick if r["section"] == "random-pool" and r["param"].startswith("n=10000 max=1MiB")]
rnd100k = [float(r["value"]) for r in quick if r["section"] == "random-pool" and r["param"].startswith("n=100000 max=1MiB")]
pinned_small = value(quick, "pinned", "pinned-pool", 4096)
inter = [float(r["value"]) for r in full if r["section"] == "interleaved" and r["subject"] == "async-pool memalloc / raw (no context current)"]
inter_on = [float(r["value"]) for r in full if r["section"] == "interleaved" and r["subject"] == "async-pool memalloc_on / raw (no context current)"]
big_copy = max((int(r["param"]) for r in quick if r["section"] == "copy-htod"), default=0)
htod = (value(quick, "copy-htod", "emm pinned", big_copy), value(quick, "copy-htod", "raw pinned", big_copy))
big_dtod = max((int(r["param"]) for r in quick if r["section"] == "copy-dtod" and r["subject"] == "emm"), default=0)
dtod = (value(quick, "copy-dtod", "emm", big_dtod), value(quick, "copy-dtod", "raw", big_dtod))
py = {}
for line in open(os.path.join(run, "python.jsonl")):
    r = json.loads(line)
    py[r["config"]] = r
held = {}
for line in open(os.path.join(run, "corpus-frameworks.jsonl")):
    if line.startswith("RESULT "):
        r = json.loads(line[len("RESULT "):])
        held[(r["trace"], r["allocator"])] = r["held_over_live"]
for r in rows("corpus-emm.csv"):
    h = int(r["pool_peak_held_bytes"] if r["manager"] == "async-pool-managed" else r["peak_held_bytes"])
    held[(r["trace"], r["manager"])] = h / int(r["peak_live_bytes"])
traces = sorted({t for t, _ in held})


def span(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-", None, None
    lo, hi = min(values), max(values)
    return (f"{lo:.3f}" if lo == hi else f"{lo:.3f} – {hi:.3f}"), lo, hi


def met(ok):
    return "**met**" if ok else "**missed**"


pool_corpus, _, pool_hi = span([held.get((t, "pool")) for t in traces])
vmm_corpus, _, vmm_hi = span([held.get((t, "vmm-pool")) for t in traces])
# Every emm manager against PyTorch's caching allocator on the same trace: (trace, manager,
# emm's figure, PyTorch's) wherever emm holds more.
emm_managers = list(dict.fromkeys(r["manager"] for r in rows("corpus-emm.csv")))
over_torch = [(t, m, held[(t, m)], held[(t, "torch")]) for t in traces for m in emm_managers
              if held.get((t, m)) is not None and held.get((t, "torch")) is not None
              and held[(t, m)] > held[(t, "torch")]]
over_managers = list(dict.fromkeys(m for _, m, _, _ in over_torch))
under_managers = [m for m in emm_managers if m not in over_managers]
# The corpus's transformer training loop through emm.torch against PyTorch's own allocator
# (compare_training.py, gpu-run.sh's call 3), where the run has it: rounds of one process per
# configuration in turn; per configuration the fastest round's median step, over PyTorch's
# fastest, as for the Python pairs (a process's host phase only adds time).
train_path = os.path.join(run, "training.jsonl")
training = [json.loads(line) for line in open(train_path)] if os.path.exists(train_path) else []
train = {}
for r in training:
    train.setdefault(r["label"], []).append(r)
train_fast = {label: min(x["step_ms_median"] for x in rs) for label, rs in train.items()}
# The sizes of the Python pairs (python/bench/bench_alloc.py's SIZES), as their files key them.
py_cols = ("256", "1048576", "67108864", "1073741824")
cupy_ratio = [py["cupy-emm"][s] / py["cupy"][s] for s in py_cols]
# CuPy's pool and emm.cupy interleaved in one process (python/bench/cupy_ab.py), where the run
# has it: each ratio from one phase of the host, so the target is read from it.
ab_path = os.path.join(run, "cupy-ab.jsonl")
ab = [json.loads(line) for line in open(ab_path)] if os.path.exists(ab_path) else []
if ab:
    cupy_ratio = [r["ratio"][s] for r in ab for s in py_cols]
    cupy_how = f" (interleaved in one process, {len(ab)} run{'s' if len(ab) > 1 else ''} of cupy_ab.py)"
else:
    cupy_how = ""
torch_ratio = [py["torch-emm"][s] / py["torch"][s] for s in py_cols]
# PyTorch's pool and emm.torch in alternate processes (gpu-run.sh's call 3), where the run has
# them: per size, the fastest process of each over the fastest of the other. A process runs in
# a fast or a slow phase of the host, about 2 x apart, which only adds time: the fastest of
# several is the allocator's cost, where one process's figure is its phase's.
prounds_path = os.path.join(run, "python-rounds.jsonl")
prounds = [json.loads(line) for line in open(prounds_path)] if os.path.exists(prounds_path) else []
if prounds:
    by_round = {}
    for r in prounds:
        by_round.setdefault(r["round"], {})[r["config"]] = r
    paired = [v for _, v in sorted(by_round.items()) if "torch" in v and "torch-emm" in v]
    fastest = {c: {s: min(v[c][s] for v in paired) for s in py_cols} for c in ("torch", "torch-emm")}
    torch_ratio = [fastest["torch-emm"][s] / fastest["torch"][s] for s in py_cols]
    torch_how = f" (the fastest of {len(paired)} alternate processes each)"
else:
    torch_how = ""
# ---- real programs on the GPU (--programs) --------------------------------------------------
PROGRAM_ORDER = ["transformer", "cnn", "server", "vit", "phase"]
ALLOCATOR_ORDER = ["torch", "torch-expandable", "pool", "vmm-pool"]
prog = {}
prog_fig = {}
if programs_run:
    sys.path.insert(0, os.path.join(root, "integration", "traces", "record"))
    import programs as programs_module  # the run's own figures: one definition of each

    for line in open(os.path.join(programs_run, "programs.jsonl")):
        r = json.loads(line)
        prog.setdefault((r["program"], r["allocator"]), []).append(r)
    for key, rs in prog.items():
        f = programs_module.figures(rs[0])
        f["step_ms"] = min(r["step_ms_median"] for r in rs if r.get("step_ms_median"))
        f["run_step_ms"] = f["step_ms"]
        prog_fig[key] = f
    # A programs run of several rounds (programs.py --rounds): steps compared by the median of
    # the same-round ratios, held memory checked in every round (its worst round).
    for (p, a), rs in prog.items():
        if len(rs) > 1 and (p, "torch") in prog:
            same_round = programs_module.round_ratios(rs, prog[(p, "torch")])
            if same_round:
                prog_fig[(p, a)]["vs_rounds"] = statistics.median(same_round)
            helds = programs_module.round_helds(rs)
            if len(helds) > 1:
                prog_fig[(p, a)]["held_worst"] = max(helds)
    # Run folders' step-rounds.jsonl (--rounds's, else the programs run's own) hold rounds of
    # some programs under PyTorch and emm's pools in turn: their steps (the fastest round)
    # replace the one run's, compared with PyTorch's by the median of the same-round ratios.
    # A round is named by its folder too, so that rounds of several folders pool.
    step_rounds = {}
    c_loops = []
    for i, folder in enumerate(rounds_runs or [programs_run]):
        rounds_path = os.path.join(folder, "step-rounds.jsonl")
        if os.path.exists(rounds_path):
            for line in open(rounds_path):
                r = json.loads(line)
                r["round"] = (i, r.get("round"))
                step_rounds.setdefault((r["program"], r["allocator"]), []).append(r)
        c_loop_path = os.path.join(folder, "torch-c-loop.jsonl")
        if os.path.exists(c_loop_path):
            c_loops += [json.loads(line) for line in open(c_loop_path) if line.strip()]
    for (p, a), rs in step_rounds.items():
        if (p, "torch") in step_rounds and (p, a) in prog_fig:
            prog_fig[(p, a)]["step_ms"] = min(r["step_ms_median"] for r in rs if r.get("step_ms_median"))
            prog_fig[(p, a)]["step_rounds"] = len(rs)
            same_round = programs_module.round_ratios(rs, step_rounds[(p, "torch")])
            if same_round:
                prog_fig[(p, a)]["vs_rounds"] = statistics.median(same_round)
                prog_fig[(p, a)]["vs_spread"] = (min(same_round), max(same_round))
                prog_fig[(p, a)]["vs_interval"] = median_interval(same_round)
            helds = programs_module.round_helds(rs)
            if helds:
                prog_fig[(p, a)]["rounds_held"] = (min(helds), max(helds))
    programs_present = [p for p in PROGRAM_ORDER if (p, "torch") in prog_fig]


def prog_span(allocator, key):
    vals = [(p, prog_fig[(p, allocator)][key]) for p in programs_present
            if (p, allocator) in prog_fig and prog_fig[(p, allocator)][key] is not None]
    return vals


def vs_torch(p, allocator):
    """A step over PyTorch's from the same call: where the step came from rounds, the median of
    each round's ratio to PyTorch's in the same round (as programs.py's table compares)."""
    f, base = prog_fig[(p, allocator)], prog_fig[(p, "torch")]
    if "vs_rounds" in f:
        return f["vs_rounds"]
    return f["step_ms"] / (base["step_ms"] if "step_rounds" in f else base["run_step_ms"])


w("## Targets")
w("")
w("| measure | target | this run | |")
w("| --- | --- | --- | --- |")
w(f"| `pool` cached pair, one thread{' (host run)' if host_run else ''} | ≤ 25 ns up to 1 MiB, ≤ 60 ns above | {min(pool_small):.1f} – {max(pool_small):.1f} ns up to 1 MiB, {min(pool_large):.1f} – {max(pool_large):.1f} ns above | {met(max(pool_small) <= 25)} up to 1 MiB; {met(max(pool_large) <= 60)} above |")
if host_run:
    live_pool = [float(r["value"]) for r in host_rows if r["section"] == "live-blocks" and r["subject"] == "pool"
                 and r["param"].endswith(" live 256 B") and not r["param"].startswith("0 live")]
    live_zero = value(host_rows, "live-blocks", "pool", "0 live 256 B")
    w(f"| `pool` pair beside 10 000 to 1 000 000 live blocks (host run) | flat in the number of live blocks | {min(live_pool):.1f} – {max(live_pool):.1f} ns at 256 B, against {live_zero:.1f} ns with none live | {met(max(live_pool) <= 1.1 * live_zero)} (within 10 %) |")
    over = [float(r["value"]) for r in host_rows if r["section"] == "overhead" and r["subject"] == "pool"]
    over_over = sorted({r["param"].rsplit(" seed=", 1)[0] for r in host_rows if r["section"] == "overhead"
                        and r["subject"] == "pool" and float(r["value"]) > 1.15})
    w(f"| memory held by `pool` over memory live, RMM's random workload (host run) | ≤ 1.15 at the peak | {min(over):.3f} – {max(over):.3f} (four workloads, three seeds) | {met(not over_over)}" + (f" ({', '.join(over_over)} over)" if over_over else "") + " |")
w(f"| `pool`, 8 / 16 threads, aggregate over one thread | ≥ 7 × / ≥ 12 × | {t8 / t1:.1f} × / {t16 / t1:.1f} × (the host's `malloc`: {value(full, 'threads', 'host malloc', threads=8) / value(full, 'threads', 'host malloc', threads=1):.1f} × / {value(full, 'threads', 'host malloc', threads=16) / value(full, 'threads', 'host malloc', threads=1):.1f} ×) | {met(t8 / t1 >= 7 and t16 / t1 >= 12)} |")
w(f"| `async-pool` pair over the raw driver pool's, interleaved in one process | ≤ 1.1 × | `memalloc` {min(inter):.3f} – {max(inter):.3f} ×; `memalloc_on` {min(inter_on):.3f} – {max(inter_on):.3f} × | {met(max(inter) <= 1.1)} for `memalloc`; {met(max(inter_on) <= 1.1)} for `memalloc_on` |")
w(f"| `pool`, RMM's random workload up to 1 MiB | ≤ 0.15 µs per operation | {min(rnd):.0f} – {max(rnd):.0f} ns at 10 000 allocations, {min(rnd100k):.0f} – {max(rnd100k):.0f} ns at 100 000 (five seeds, quick run) | {met(max(rnd) <= 150)} at 10 000; {met(max(rnd100k) <= 150)} at 100 000 |")
if programs_run:
    def described(vals, fmt, limit):
        text = ", ".join(f"{p} {v:{fmt}}" for p, v in vals)
        missed = [p for p, v in vals if v > limit]
        return text, missed

    def verdict(missed):
        return met(not missed) + (f" ({', '.join(missed)} over)" if missed else "")

    rows_out = []
    for allocator, limit in (("pool", 1.25), ("vmm-pool", 1.10)):
        vals = [(p, prog_fig[(p, allocator)].get("held_worst", v)) for p, v in prog_span(allocator, "held_over_live")]
        text, missed = described(vals, ".3f", limit)
        if any("held_worst" in prog_fig[(p, allocator)] for p, _ in vals):
            text += " (each program's worst round)"
        rows_out.append((f"`{allocator}` ≤ {limit:.2f}", text, verdict(missed), allocator))
    w("| memory held over peak live, real programs on the GPU | " + "; ".join(r[0] for r in rows_out)
      + " | " + "; ".join(f"`{r[3]}` {r[1]}" for r in rows_out) + " | "
      + "; ".join(f"`{r[3]}` {r[2]}" for r in rows_out) + " |")
    exp_missed = [p for p in programs_present if (p, "vmm-pool") in prog_fig and (p, "torch-expandable") in prog_fig
                  and prog_fig[(p, "vmm-pool")]["held_over_live"] > prog_fig[(p, "torch-expandable")]["held_over_live"]]
    w("| `vmm-pool` against PyTorch with expandable segments, same program | never above | "
      + ", ".join(f"{p} {prog_fig[(p, 'vmm-pool')]['held_over_live']:.3f} against {prog_fig[(p, 'torch-expandable')]['held_over_live']:.3f}"
                  for p in programs_present if (p, "vmm-pool") in prog_fig and (p, "torch-expandable") in prog_fig)
      + f" | {verdict(exp_missed)} |")
    torch_missed = [f"{p} `{a}`" for p in programs_present for a in ("pool", "vmm-pool")
                    if (p, a) in prog_fig and prog_fig[(p, a)]["held_over_live"] > prog_fig[(p, "torch")]["held_over_live"]]
    w("| every manager against PyTorch's caching allocator, same program | never above | "
      + "PyTorch " + ", ".join(f"{p} {prog_fig[(p, 'torch')]['held_over_live']:.3f}" for p in programs_present)
      + f" | {verdict(torch_missed)} |")
    cells = []
    verdicts = []
    for allocator in ("pool", "vmm-pool"):
        text, missed = described(prog_span(allocator, "per_100_after_warmup"), ".2f", 1.0)
        cells.append(f"`{allocator}` {text}")
        verdicts.append(f"`{allocator}` {verdict(missed)}")
    w("| driver allocations per 100 allocations after the first tenth of a program | ≤ 1 | "
      + "; ".join(cells) + " | " + "; ".join(verdicts) + " |")
    cells = []
    verdicts = []
    for allocator in ("pool", "vmm-pool"):
        vals = [(p, vs_torch(p, allocator)) for p in programs_present if (p, allocator) in prog_fig]
        text, missed = described(vals, ".3f", 1.03)
        cells.append(f"`{allocator}` {text}")
        verdicts.append(f"`{allocator}` {verdict(missed)}")
    w("| step time over PyTorch's own allocator, same program | ≤ 1.03 × | " + "; ".join(cells)
      + " | " + "; ".join(verdicts) + " |")
else:
    w(f"| memory held over peak live, corpus | `pool` ≤ 1.25, `vmm-pool` ≤ 1.10 | `pool` {pool_corpus}; `vmm-pool` {vmm_corpus} | `pool` {met(pool_hi <= 1.25)}; `vmm-pool` {met(vmm_hi <= 1.10)} |")
if programs_run:
    pass
elif over_torch:
    # Managers over PyTorch by the same figure on a trace (the async-pool family shares the
    # driver's pool) are named together, with RMM's async resource where it holds the same.
    groups = {}
    for t, m, v, p in over_torch:
        groups.setdefault((t, round(v, 3), p), []).append(m)
    over_text = "; ".join(
        f"{t} {v:.3f} ({', '.join(f'`{m}`' for m in ms)}"
        + (", as RMM's async resource" if held.get((t, "rmm-async")) is not None and round(held[(t, "rmm-async")], 3) == v else "")
        + f") against {p:.3f}" for (t, v, p), ms in groups.items())
    w(f"| every manager's held over peak live, corpus | never above PyTorch's caching allocator on the same trace | above it: {over_text}; every other figure at or below | "
      + ", ".join(f"`{m}`" for m in under_managers) + " **met**; " + ", ".join(f"`{m}`" for m in over_managers) + " **missed** |")
elif emm_managers:
    w("| every manager's held over peak live, corpus | never above PyTorch's caching allocator on the same trace | every figure at or below PyTorch's | **met** |")
if "torch" in train_fast and not programs_run:
    step = {m: train_fast[f"emm {m}"] / train_fast["torch"] for m in ("pool", "vmm-pool") if f"emm {m}" in train_fast}
    w("| training loop step time (corpus transformer, 100 steps), over PyTorch's own allocator | ≤ 1.03 × | "
      + "; ".join(f"`{m}` {v:.3f} ×" for m, v in step.items())
      + f" (the fastest of {len(train['torch'])} rounds each) | " + "; ".join(f"`{m}` {met(v <= 1.03)}" for m, v in step.items()) + " |")
w(f"| pinned host pool, cached pair | ≤ 40 ns | {pinned_small:.1f} ns at 4 KiB | {met(pinned_small <= 40)} |")
w(f"| copies through the runtime, pinned host to device / device to device, largest size | ≥ 97 % of raw | {100 * htod[0] / htod[1]:.0f} % at {size(big_copy)} / {100 * dtod[0] / dtod[1]:.0f} % at {size(big_dtod)} | {met(htod[0] / htod[1] >= 0.97 and dtod[0] / dtod[1] >= 0.97)} |")
w(f"| a framework through emm over its own pool, from Python | CuPy ≤ 1.15 ×, PyTorch ≤ 1.1 × | CuPy {min(cupy_ratio):.2f} – {max(cupy_ratio):.2f} ×{cupy_how}; PyTorch {min(torch_ratio):.2f} – {max(torch_ratio):.2f} ×{torch_how} | CuPy {met(max(cupy_ratio) <= 1.15)}; PyTorch {met(max(torch_ratio) <= 1.1)} |")
w("")
w("The default manager's overhead over raw `cuMemAlloc` + `cuMemFree` (target ≤ 1 %) cannot be read")
w("from wall-clock times whose own spread between sequences is larger; its bookkeeping is held to")
w("400 instructions a pair on the simulator in CI instead (below).")
w("")

# ---- pairs --------------------------------------------------------------------------------
w(f"## Alloc + free pair, one thread ({pair_from})")
w("")
subjects = ["pool", "async-pool", "default", "driver-pool", "cuMemAlloc"]
w("| size | " + " | ".join(f"`{s}`" if s in ("pool", "async-pool", "default") else s for s in subjects) + " | `pool` under the driver pool |")
w("| --- |" + " ---: |" * (len(subjects) + 1))
for s in sizes:
    vals = [value(pair_src, "pair", sub, s) for sub in subjects]
    w(f"| {size(s)} | " + " | ".join(ns(v) for v in vals) + f" | {value(pair_src, 'pair', 'driver-pool', s) / value(pair_src, 'pair', 'pool', s):.0f} × |")
host = value(pair_src, "pair", "host malloc", 256)
sim = value(pair_src, "pair", "pool on the simulator", 256)
w("")
w(f"Beside them: the host's own `malloc` + `free` of 256 B, {host:.1f} ns; the `pool` pair on the simulated")
w(f"driver, {sim:.1f} ns; PyTorch's and CuPy's own pools from Python (`bench_peers.py`, call 2):")
pt = {r[2]: float(r[4]) for r in peers if len(r) > 4 and r[1] == "pytorch"}
cp = {r[2]: float(r[4]) for r in peers if len(r) > 4 and r[1] == "cupy"}
w(f"{ns(min(pt.values()))} – {ns(max(pt.values()))} and {ns(min(cp.values()))} – {ns(max(cp.values()))}.")
w("")
w("![alloc + free latency per size](bench-results/pair-latency.svg)")
w("")
if host_run:
    w("## The pool's history ring: three builds on one host (host run)")
    w("")
    w("The `pool` pair of three builds of bench_gpu, each run twice in turn on one machine: `old`")
    w("reads the time-stamp counter at every allocation, `head` every 32 events of a thread and at")
    w("refills, `noring` records no history at all (built for this measurement only).")
    w("")
    w("| build, round | 256 B | 4 KiB | 64 KiB | 1 MiB | host `malloc` + `free`, 256 B |")
    w("| --- | ---: | ---: | ---: | ---: | ---: |")
    for build in ("old", "head", "noring"):
        for rnd_ in ("1", "2"):
            sel = [r for r in all_pairs if r["build"] == build and r["round"] == rnd_]
            cells = [value(sel, "pair", "pool", sz) for sz in sizes[:4]]
            w(f"| `{build}`, {rnd_} | " + " | ".join(ns(c) for c in cells) + f" | {ns(value(sel, 'pair', 'host malloc', 256))} |")
    w("")
    w("## The `pool` pair beside many live blocks (host run)")
    w("")
    w("256 B blocks held, then pairs of 256 B and 64 KiB beside them (median of 5 batches); the")
    w("first row holds a million heap boxes of 112 B instead of blocks (the host's side alone).")
    w("")
    w("| live blocks | `pool` 256 B | `pool` 64 KiB | `async-pool` 256 B | `async-pool` 64 KiB |")
    w("| --- | ---: | ---: | ---: | ---: |")
    live_params = list(dict.fromkeys(r["param"].replace(" 256 B", "").replace(" 65536 B", "")
                                      for r in host_rows if r["section"] == "live-blocks" and " again" not in r["param"]))
    for lp in live_params:
        def lv(sub, b):
            return value(host_rows, "live-blocks", sub, lp.replace(" live", f" live {b} B", 1))
        w(f"| {lp} | {ns(lv('pool', 256))} | {ns(lv('pool', 65536))} | {ns(lv('async-pool', 256))} | {ns(lv('async-pool', 65536))} |")
    w("")
    w("## Memory held over peak live, RMM's random workload (host run)")
    w("")
    w("Peak bytes held from the driver over peak bytes asked for, three seeds each; the raw driver")
    w("pool ran the same sequence in the same run (its reserved and used high marks).")
    w("")
    w("| workload | `pool` | `async-pool` | raw driver pool, reserved high | raw driver pool, used high |")
    w("| --- | --- | --- | --- | --- |")
    for wl in dict.fromkeys(r["param"].rsplit(" seed=", 1)[0] for r in host_rows if r["section"] == "overhead"):
        def ov(sub):
            vs = [r["value"] for r in host_rows if r["section"] == "overhead" and r["subject"] == sub
                  and r["param"].startswith(wl + " seed=")]
            return " / ".join(f"{float(v):.3f}" for v in vs)
        w(f"| {wl.replace('n=', '').replace(' max=', ' allocations, up to ')} | {ov('pool')} | {ov('async-pool')} | {ov('raw pool reserved')} | {ov('raw pool used')} |")
    w("")

# ---- interleaved --------------------------------------------------------------------------
w("## `async-pool` against the raw driver pool, interleaved (call 1)")
w("")
w("Each process times emm's pair and the raw pool's pair in turns, so that the host's phases hit")
w("both; the ratio is of the medians.")
w("")
w("| size | raw pool (legacy stream) | `memalloc` | ratio | raw pool (a stream) | `memalloc_on` | ratio | `memalloc_on_raw` | ratio |")
w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for s in sorted({r["param"] for r in full if r["section"] == "interleaved"}, key=int):
    def iv(sub):
        return value(full, "interleaved", f"{sub} (no context current)", s)
    w(f"| {size(s)} | {ns(iv('raw-own-pool legacy'))} | {ns(iv('async-pool memalloc'))} | {iv('async-pool memalloc / raw'):.3f} | {ns(iv('raw-own-pool stream'))} | {ns(iv('async-pool memalloc_on'))} | {iv('async-pool memalloc_on / raw'):.3f} | {ns(iv('async-pool memalloc_on_raw'))} | {iv('async-pool memalloc_on_raw / raw'):.3f} |")
w("")
w("With a context current on the thread the ratios are in the run's files (`(context current)` rows).")
w("")

# ---- threads ----------------------------------------------------------------------------
w("## Threads: small pairs (256 B – 32 KiB), aggregate millions of pairs a second")
w("")
w("| threads | `pool` (call 1) | host `malloc` (call 1) | `pool` (call 2) | `async-pool` (call 2) | raw driver pool, legacy stream (call 2) | `async-pool` over raw |")
w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for n in (1, 2, 4, 8, 16, 32):
    a = value(full, "threads", "pool", threads=n)
    m = value(full, "threads", "host malloc", threads=n)
    b = value(quick, "threads", "pool", threads=n)
    ap = value(quick, "threads", "async-pool", threads=n)
    raw = value(quick, "threads", "raw pool legacy stream 8 held", threads=n)
    f = lambda v: "-" if v is None else f"{v:.2f}" if v < 10 else f"{v:.1f}"
    w(f"| {n} | {f(a)} | {f(m)} | {f(b)} | {f(ap)} | {f(raw)} | {ratio(ap, raw) if raw else '-'} |")
w("")

# ---- stream-ordered ---------------------------------------------------------------------
w("## Stream-ordered pairs on a created stream (call 2)")
w("")
w("| size | `pool` | `async-pool` | `default` (fenced) | raw pool | emm device resource | raw pinned pool | emm pinned resource | raw managed pool | emm managed resource |")
w("| --- |" + " ---: |" * 9)
for s in sorted({r["param"] for r in quick if r["section"] == "stream"}, key=int):
    cells = [value(quick, "stream", sub, s) for sub in ("pool", "async-pool", "default", "raw-own-pool", "emm-device-resource", "raw-pinned-pool", "emm-pinned-resource", "raw-managed-pool", "emm-managed-resource")]
    w(f"| {size(s)} | " + " | ".join(ns(c) for c in cells) + " |")
w("")
w("Threads on streams, millions of pairs a second (call 2):")
w("")
w("| threads, streams | `pool` | `async-pool` | raw driver pool | `async-pool` over raw |")
w("| --- | ---: | ---: | ---: | ---: |")
for param, n in (("own-streams", 1), ("own-streams", 8), ("own-streams", 16), ("one-stream", 8)):
    p_ = value(quick, "stream-threads", "pool", param, n)
    a_ = value(quick, "stream-threads", "async-pool", param, n)
    r_ = value(quick, "stream-threads", "raw-own-pool", param, n)
    w(f"| {n}, {'one stream each' if param == 'own-streams' else 'one stream for all'} | {p_:.2f} | {a_:.3f} | {r_:.3f} | {100 * a_ / r_:.0f} % |")
w("")

# ---- random workload ----------------------------------------------------------------------
w("## RMM's random workload (`pool`, ns per operation, five seeds, call 2)")
w("")
w("| allocations, largest size | seeds |")
w("| --- | --- |")
for key in ("n=10000 max=1MiB", "n=100000 max=1MiB", "n=10000 max=64MiB", "n=100000 max=64MiB"):
    vals = [float(r["value"]) for r in quick if r["section"] == "random-pool" and r["param"].startswith(key + " ")]
    w(f"| {key.replace('n=', '').replace(' max=', ', up to ')} | " + ", ".join(f"{v:.0f}" for v in vals) + " |")
w("")

# ---- pinned and copies --------------------------------------------------------------------
w("## Pinned host memory and copies (call 2)")
w("")
w("| size | pinned pool pair | `cuMemHostAlloc` + free | ratio |")
w("| --- | ---: | ---: | ---: |")
for s in sorted({r["param"] for r in quick if r["section"] == "pinned"}, key=int):
    a, b = value(quick, "pinned", "pinned-pool", s), value(quick, "pinned", "cuMemHostAlloc", s)
    w(f"| {size(s)} | {ns(a)} | {ns(b)} | {b / a:,.0f} × |".replace(",", " "))
w("")
w("| size | host → device, emm pinned | raw pinned | % | emm pageable | device → device, emm | raw | % |")
w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for s in sorted({r["param"] for r in quick if r["section"] == "copy-htod"}, key=int):
    a, b = value(quick, "copy-htod", "emm pinned", s), value(quick, "copy-htod", "raw pinned", s)
    pg = value(quick, "copy-htod", "emm pageable", s)
    c, d = value(quick, "copy-dtod", "emm", s), value(quick, "copy-dtod", "raw", s)
    g = lambda v: "-" if v is None else f"{v:.1f} GB/s"
    pc = lambda x, y: "-" if x is None or y is None else f"{100 * x / y:.0f}"
    w(f"| {size(s)} | {g(a)} | {g(b)} | {pc(a, b)} | {g(pg)} | {g(c)} | {g(d)} | {pc(c, d)} |")
w("")

# ---- default manager ----------------------------------------------------------------------
w("## The default manager against raw `cuMemAlloc` + `cuMemFree` (call 2)")
w("")
w("The raw anchor makes the manager's own sequence (11 allocations, then 11 frees: its deferred")
w("frees are issued in batches), per pair:")
w("")
w("| size | default manager | raw, its sequence | ratio | raw, alternating |")
w("| --- | ---: | ---: | ---: | ---: |")
for s in sorted({r["param"] for r in quick if r["section"] == "default"}, key=int):
    a = value(quick, "default", "default manager", s)
    b = value(quick, "default", "raw 11 allocs then 11 frees", s)
    c = value(quick, "default", "raw alternating", s)
    w(f"| {size(s)} | {ns(a)} | {ns(b)} | {a / b:.2f} | {ns(c)} |")
w("")

# ---- Python -------------------------------------------------------------------------------
w("## Python: Numba, CuPy and PyTorch over emm (`pool`), µs a pair (call 2)")
w("")
w("| configuration | 256 B | 1 MiB | 64 MiB | 1 GiB |")
w("| --- | ---: | ---: | ---: | ---: |")
names = {"numba": "Numba's own", "numba-rmm": "Numba over RMM's pool", "numba-emm": "Numba over `emm.numba`",
         "cupy": "CuPy's pool", "cupy-rmm": "CuPy over RMM's pool", "cupy-emm": "CuPy over `emm.cupy` (C functions)",
         "cupy-emm-py": "CuPy over `emm.cupy` (Python)", "torch": "PyTorch's caching allocator",
         "torch-rmm": "PyTorch over RMM", "torch-emm": "PyTorch over `emm.torch.install()`",
         "torch-emm-mempool": "PyTorch's pool over `emm.torch.mem_pool()`", "emm": "`emm.context().memalloc` alone"}
for c, label in names.items():
    r = py.get(c)
    if r:
        w(f"| {label} | " + " | ".join(f"{r[s]:.3f}" for s in py_cols) + " |")
rounds_path = os.path.join(run, "python-cupy-rounds.jsonl")
if os.path.exists(rounds_path):
    rs = [json.loads(line) for line in open(rounds_path)]
    pairs = [(a["256"], b["256"]) for a, b in zip(rs[0::2], rs[1::2])]
    w("")
    w("CuPy's processes land in fast and slow phases of the host (one process per figure above).")
    w(f"{info['call3'][0].upper()}{info['call3'][1:]}, at 256 B: " + "; ".join(f"{a:.3f} against {b:.3f} µs ({b / a:.2f} ×)" for a, b in pairs) + ".")
w("")

if ab:
    w("CuPy's pool and `emm.cupy` interleaved in one process (`python/bench/cupy_ab.py`: the allocator")
    w("switched before every batch, the order alternating between rounds), µs a pair, the median over")
    w("the rounds; the ratio is the median of the rounds' own ratios. `cfloor` is CuPy's C allocator")
    w("interface over functions that do nothing: CuPy's own share of `emm.cupy`'s pair.")
    w("")
    w("| run | allocator | 256 B | 1 MiB | 64 MiB | 1 GiB |")
    w("| --- | --- | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(ab, 1):
        for key, label in (("cupy", "CuPy's pool"), ("cupy-emm", "`emm.cupy`"), ("cupy-cfloor", "cfloor")):
            if key in r:
                w(f"| {i} | {label} | " + " | ".join(f"{r[key][c]:.3f}" for c in py_cols) + " |")
        w(f"| {i} | ratio, `emm.cupy` over CuPy's pool ({r['rounds']} rounds) | " + " | ".join(f"{r['ratio'][c]:.3f} ×" for c in py_cols) + " |")
    w("")

if prounds:
    w("PyTorch takes its allocator once per process, so its pool and `emm.torch` cannot share one.")
    w(f"{info['call3'][0].upper()}{info['call3'][1:]}: µs a pair, each cell 256 B / 1 MiB / 64 MiB /")
    w("1 GiB. A process runs in a fast or a slow phase of the host, about 2 × apart, whichever")
    w("allocator it uses (and sometimes changes phase midway); the target reads the fastest of each.")
    w("")
    w("| round | PyTorch's pool | `emm.torch` | `emm.torch` over PyTorch's pool |")
    w("| --- | --- | --- | --- |")
    for i, v in enumerate(paired, 1):
        w(f"| {i} | " + " / ".join(f"{v['torch'][c]:.3f}" for c in py_cols) + " | "
          + " / ".join(f"{v['torch-emm'][c]:.3f}" for c in py_cols) + " | "
          + " / ".join(f"{v['torch-emm'][c] / v['torch'][c]:.2f}" for c in py_cols) + " |")
    w("| fastest | " + " / ".join(f"{fastest['torch'][c]:.3f}" for c in py_cols) + " | "
      + " / ".join(f"{fastest['torch-emm'][c]:.3f}" for c in py_cols) + " | "
      + " / ".join(f"{r:.2f}" for r in torch_ratio) + " |")
    w("")

# ---- memory: real programs (--programs), else the corpus replays ----------------------------
if programs_run:
    w("## Memory held by real programs on the GPU")
    w("")
    w("Five PyTorch programs (`integration/traces/record/programs.py`: a transformer encoder trained")
    w("300 steps with batch and sequence drawn per step; a ResNet-style CNN, 120 steps, batch and image")
    w("size drawn per step; a server of four threads, a stream and page-locked inputs each, 150 requests")
    w("a thread; a ViT in bf16 with activation checkpointing and gradient accumulation, 60 steps; a")
    w("large transformer trained 60 steps, `torch.cuda.empty_cache()`, then a small one serving), each")
    w("under PyTorch's caching allocator, with expandable segments, and emm's pools through")
    w("`emm.torch.install()`, one process each, with their kernels in flight. Held: the allocator's peak")
    w("(`max_memory_reserved()`, emm's pool peak) over the program's peak live bytes; driver")
    w("allocations and frees: `num_device_alloc` / `num_device_free`, emm's `cuMemAlloc` or (under")
    w("`vmm-pool`) `cuMemCreate` calls and `cuMemFree` / `cuMemRelease`; per 100: driver allocations per")
    w("100 allocations after the first tenth of the run; given back: bytes returned to the driver;")
    w("step: the median step (the server: a request). Every run's losses or outputs agree with")
    w("PyTorch's (1e-3 relative; 5e-2 on the CNN, whose cuDNN algorithms PyTorch's own two")
    w("configurations disagree on by 2e-2).")
    w("")
    w("| program | allocator | live MiB | held MiB | held / live | driver allocs | driver frees | per 100 | given back GB | step ms | over PyTorch's |")
    w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    names = {"torch": "PyTorch", "torch-expandable": "PyTorch, expandable segments",
             "pool": "`pool`", "vmm-pool": "`vmm-pool`"}
    for p in programs_present:
        for a in ALLOCATOR_ORDER:
            f = prog_fig.get((p, a))
            if f is None:
                continue
            w(f"| {p} | {names[a]} | {f['live'] / 2**20:.0f} | {f['held'] / 2**20:.0f} | {f['held_over_live']:.3f} | "
              f"{f['driver_allocations']} | {f['driver_frees']} | {f['per_100_after_warmup']:.2f} | "
              f"{f['given_back'] / 1e9:.1f} | {f['step_ms']:.2f}{' †' if 'step_rounds' in f else ''} | {vs_torch(p, a):.3f} × |")
    from_rounds = [(p, a) for p in programs_present for a in ALLOCATOR_ORDER
                   if "step_rounds" in prog_fig.get((p, a), {})]
    if from_rounds:
        counts = sorted({prog_fig[k]["step_rounds"] for k in from_rounds})
        one_run = "; ".join(f"{p} {names[a]} {prog_fig[(p, a)]['run_step_ms'] / prog_fig[(p, 'torch')]['run_step_ms']:.3f}"
                            for p, a in from_rounds if a != "torch")
        spread = "; ".join(f"{p} {names[a]} {prog_fig[(p, a)]['vs_spread'][0]:.3f} – {prog_fig[(p, a)]['vs_spread'][1]:.3f}"
                           f" (median's interval {prog_fig[(p, a)]['vs_interval'][0]:.3f} – {prog_fig[(p, a)]['vs_interval'][1]:.3f})"
                           for p, a in from_rounds if a != "torch" and "vs_spread" in prog_fig[(p, a)])
        held = "; ".join(f"{p} {names[a]} {prog_fig[(p, a)]['rounds_held'][0]:.3f} – {prog_fig[(p, a)]['rounds_held'][1]:.3f}"
                         for p, a in from_rounds if a in ("pool", "vmm-pool") and "rounds_held" in prog_fig[(p, a)])
        w("")
        where = ("runs of their own" if len(rounds_runs) > 1 else "a run of its own") if rounds_runs else "a later call"
        w(f"† The fastest of {' or '.join(map(str, counts))} rounds in {where} "
          "(`step-rounds.jsonl`: PyTorch and emm's pools in turn, one process each); the ratio is the median "
          "of each round's ratio to PyTorch's in the same round (its range over the rounds, and a 90 % "
          "bootstrap interval of the median: " + spread + "); these programs' step varies "
          f"by more than the target from run to run. The one run's ratios were: {one_run}. Held over peak "
          f"live in those rounds: {held}.")
        floors = []
        for p in programs_present:
            for a, what in (("torch-async", "through its native interface (`torch-async`)"),
                            ("torch-floor", "through the pluggable interface emm uses, with nothing else (`torch-floor`)")):
                same_round = programs_module.round_ratios(step_rounds.get((p, a), []), step_rounds.get((p, "torch"), []))
                if same_round:
                    lo, hi = median_interval(same_round)
                    floors.append(f"{p} {what} {statistics.median(same_round):.3f} ({len(same_round)} rounds, "
                                  f"{min(same_round):.3f} – {max(same_round):.3f}; median's interval {lo:.3f} – {hi:.3f})")
        if floors:
            w("")
            w("PyTorch over the driver's stream-ordered pool in the same rounds, over PyTorch's own step: "
              + "; ".join(floors) + ".")
        if c_loops:
            def pair_range(key):
                vals = [r[k] for r in c_loops for k in r if k.startswith(key + "_")]
                return f"{min(vals):.0f} – {max(vals):.0f} ns"
            managers = ", ".join(sorted({f"`{r['manager']}`" for r in c_loops}))
            w("")
            w(f"A pair of emm.torch's C functions from a C loop on the GPU (`python/bench/torch_c_loop.py`, "
              f"256 B and 1 MiB, under {managers}): {pair_range('emm')}; the floor's pair (`cuMemAllocAsync` "
              f"and `cuMemFreeAsync`): {pair_range('floor')}.")
    phase = prog.get(("phase", "pool"), [{}])[0]
    if "held_after_empty_cache" in phase:
        after = {a: prog[("phase", a)][0]["held_after_empty_cache"] / 2**20 for a in ALLOCATOR_ORDER if ("phase", a) in prog}
        w("")
        w("After the phase change's `torch.cuda.empty_cache()`, held: "
          + ", ".join(f"{names[a]} {v:.0f} MiB" for a, v in after.items()) + ".")
    # Each run with logged programs and their replay: --logged's, else the programs run's own.
    replays = []
    for folder in logged_runs or [programs_run]:
        sim_path = os.path.join(folder, "replay-sim.csv")
        logged_path = os.path.join(folder, "programs-logged.jsonl")
        if os.path.exists(sim_path) and os.path.exists(logged_path):
            replays.append((folder, sim_path, logged_path))
    if replays:
        several = len(replays) > 1
        w("")
        w("### The same runs replayed on the simulator")
        w("")
        w("Programs run again under the `log` adaptor (whose `Reached` column records how far the GPU")
        w("had got through each stream), each log replayed on the simulator under the manager it ran")
        w("under, with that progress, the GPU running on to the middle of each recorded call while the")
        w("manager decides (`replay`; `run.txt` says how). The replay of a four-thread log orders the")
        w("threads' events as the log's lock did." + (
            " These runs are later calls of their own (the files above), so their figures differ"
            " from the table above's." if logged_runs else ""))
        w("")
        w(("| run " if several else "") + "| program | manager | held / live, GPU | replay | "
          "driver allocations, GPU | replay | within 10 % |")
        w(("| --- " if several else "") + "| --- | --- | ---: | ---: | ---: | ---: | --- |")
        unreplayed = []
        for folder, sim_path, logged_path in replays:
            commit = run_info(folder)["commit"].split()[0]
            logged = {}
            for line in open(logged_path):
                r = json.loads(line)
                logged[(r["program"], r["allocator"])] = programs_module.figures(r)
            replayed = set()
            for r in csv.DictReader(open(sim_path)):
                p, m = r["trace"].rsplit(".", 1)[0], r["manager"]
                g = logged.get((p, m))
                if g is None:
                    continue
                replayed.add((p, m))
                held_off = float(r["held_over_live"]) / g["held_over_live"] - 1
                allocs_off = int(r["driver_allocations"]) / max(g["driver_allocations"], 1) - 1
                off = [f"{what} {d:+.1%}" for what, d in (("held", held_off), ("driver allocations", allocs_off))
                       if abs(d) > 0.10]
                verdict = "**met**" if not off else "**missed** (" + ", ".join(off).replace("%", " %") + ")"
                w((f"| {commit} " if several else "") + f"| {p} | `{m}` | {g['held_over_live']:.3f} | "
                  f"{float(r['held_over_live']):.3f} | {g['driver_allocations']} | {r['driver_allocations']} | {verdict} |")
            unreplayed += [f"{p} under `{m}`" + (f" ({commit})" if several else "")
                           for p, m in logged if (p, m) not in replayed]
        if unreplayed:
            w("")
            w("Logged in the same call but not replayed here (`run.txt` says why): "
              + ", ".join(unreplayed) + ".")
    w("")

# ---- corpus -------------------------------------------------------------------------------
if not programs_run:
    w("## Memory held on real workloads (call 1)")
    w("")
    w("Peak device memory held over peak live bytes, each trace of the corpus (`integration/traces`,")
    w("six programs recorded through the `log` adaptor) replayed on the GPU: what `cudaMemGetInfo`")
    w("counts as used, read after every allocation, over what the process used before the trace")
    w("(`async-pool-managed`: its pool's own peak, as managed memory not yet resident is not counted).")
    w("RMM's arena reserves its default size when it is made.")
    w("")
    cols = [("PyTorch", "torch"), ("PyTorch expandable", "torch-expandable"), ("CuPy", "cupy"),
            ("RMM pool", "rmm-pool"), ("RMM arena", "rmm-arena"), ("RMM async", "rmm-async"),
            ("`default`", "default"), ("`pool`", "pool"), ("`vmm-pool`", "vmm-pool"),
            ("`async-pool`", "async-pool"), ("`-ipc`", "async-pool-ipc"), ("`-managed`", "async-pool-managed")]
    w("| trace | " + " | ".join(c for c, _ in cols) + " |")
    w("| --- |" + " ---: |" * len(cols))
    for t in traces:
        w(f"| {t} | " + " | ".join("-" if held.get((t, a)) is None else f"{held[(t, a)]:.3f}" for _, a in cols) + " |")
    w("")


# ---- training loop ------------------------------------------------------------------------
if training and not programs_run:
    live = train["torch"][0]["memory"]["max_allocated"]
    w("## A training loop through `emm.torch` (call 3)")
    w("")
    w("The corpus's transformer (`integration/traces/record/torch_transformer.py`: 4 encoder layers,")
    w("batch and sequence drawn per step, fixed seeds), 100 steps, one process per configuration in")
    w(f"turn, {len(train['torch'])} rounds (`compare_training.py --managers pool,vmm-pool`). Step: the median step")
    w("of each round; held: the most the allocator held (PyTorch's `max_memory_reserved()`, emm's pool")
    w("peak), over PyTorch's `max_memory_allocated()`; losses: the largest relative difference from")
    w("PyTorch's own allocator's over all steps and rounds.")
    w("")
    w("| run | step ms per round | fastest over PyTorch's | held MiB | held / live | losses |")
    w("| --- | --- | ---: | ---: | ---: | ---: |")
    names = {"torch": "PyTorch", "torch expandable": "PyTorch, expandable segments",
             "emm pool": "`pool`", "emm vmm-pool": "`vmm-pool`"}
    for label, rs in train.items():
        steps = " / ".join(f"{x['step_ms_median']:.2f}" for x in rs)
        peak = max(x["held_bytes"] or 0 for x in rs)
        diff = max(x["loss_rel_diff"] for x in rs)
        w(f"| {names.get(label, label)} | {steps} | {train_fast[label] / train_fast['torch']:.3f} × | {peak / 2**20:.0f} | {peak / live:.3f} | {diff:.1e} |")
    w("")

# ---- sleep and wake (--sleep) ---------------------------------------------------------------
if sleep_run:
    h = json.load(open(os.path.join(sleep_run, "handoff.json")))
    sl, wk, idle = h["sleep"], h["wake"], h["idle"]
    pinned = h["pinned_rate_bytes_per_s"]
    gb = lambda b: f"{b / 1e9:.1f} GB"
    w("## Sleep and wake (`vmm-pool`)")
    w("")
    w("A trainer under `emm.torch` (an MLP of 8 layers of 8192 × 8192, fp32, Adam) sleeps with its")
    w("weights and optimizer state offloaded and the rest discarded; a second process takes the")
    w("device and frees it; the trainer wakes and trains on. Its losses beside an uninterrupted")
    w("run's, and the copy rates beside PyTorch's own pinned copies of 4 GiB on the same machine")
    w("(`python/bench/sleep_handoff.py`).")
    w("")
    w("| measure | this run | anchor | target | |")
    w("| --- | ---: | ---: | --- | --- |")
    same = "bit-identical" if h["losses_identical"] else "different"
    w(f"| losses after the hand-off | {same} | the uninterrupted run's | bit-identical | {met(not not h['losses_identical'])} |")
    w(f"| held before / while asleep | {gb(sl['held_before_bytes'])} / {gb(sl['held_asleep_bytes'])} | | what was asked to stay (nothing) | {met(not sl['held_asleep_bytes'] != 0)} |")
    w(f"| the other process took | {gb(h['other']['took_bytes'])} | | | |")
    off, res = h["offload_rate_bytes_per_s"], h["restore_rate_bytes_per_s"]
    w(f"| offload, {gb(sl['offloaded_bytes'])} to pinned host memory | {off / 1e9:.1f} GB/s | {pinned['d2h'] / 1e9:.1f} GB/s | ≥ 80 % of the pinned rate | {met(not off < 0.8 * pinned['d2h'])} ({off / pinned['d2h']:.0%}) |")
    w(f"| restore at the wake | {res / 1e9:.1f} GB/s | {pinned['h2d'] / 1e9:.1f} GB/s | ≥ 80 % of the pinned rate | {met(not res < 0.8 * pinned['h2d'])} ({res / pinned['h2d']:.0%}) |")
    w(f"| sleep, all told (the wait, the host buffer's allocation, the copies, the unmapping) | {sl['seconds']:.2f} s | | | |")
    w(f"| wake, all told (new pieces mapped, the copies back) | {wk['seconds']:.2f} s | | | |")
    for k, r in enumerate(h.get("repeat", [])):
        kept = "reused" if r["sleep"]["host_buffer_reused"] else "pinned anew"
        what = "the same sleep with `keep_host_buffer=True`" if k == 0 else "again, the buffer kept"
        w(f"| {what} ({kept}) / its wake | {r['sleep']['seconds']:.2f} s / {r['wake']['seconds']:.2f} s | | | |")
    pieces = sinfo.get("pieces", "of 2 MiB (the default)")
    w(f"| sleep with nothing to offload, {gb(idle['held_bytes'])} held, pieces {pieces} | {idle['sleep_seconds'] * 1e3:.0f} ms | | < 100 ms | {met(not idle['sleep_seconds'] >= 0.1)} |")
    w(f"| its wake | {idle['wake_seconds'] * 1e3:.0f} ms | | | |")
    big = h.get("idle_32mib_pieces")
    if big:
        w(f"| the same, `EMM_VMM_PIECE=32MiB` | {big['sleep_seconds'] * 1e3:.0f} ms | | < 100 ms | {met(not big['sleep_seconds'] >= 0.1)} |")
        w(f"| its wake | {big['wake_seconds'] * 1e3:.0f} ms | | | |")
    w("")
    w("The sleep with nothing to offload unmaps and releases each piece of physical memory on its own")
    w("(two driver calls a piece, which the driver runs one at a time, at a cost per piece whatever")
    w("its size); `EMM_VMM_PIECE` sets one piece size for all (docs/python.md, sleep and wake).")
    w(f"The offloading sleep's copies took {sl['offload_seconds']:.2f} s of its {sl['seconds']:.2f} s;")
    w("the rest is the wait for the device, the page-locked buffer's allocation and the unmapping,")
    w("not timed apart.")
    w("")
    tms_path = os.path.join(sleep_run, "sleep-vs-tms.json")
    if os.path.exists(tms_path):
        t = json.load(open(tms_path))
        w("### Beside torch_memory_saver")
        w("")
        w("The same tensors under emm (`emm.torch.sleep` / `wake`, `vmm-pool`) and under")
        w(f"torch_memory_saver {sinfo.get('tms', '')} (its wheel from PyPI, in its `torch` hook mode: `region`,")
        w("`pause` / `resume`),")
        w("each case a process of its own in the same call (`python/bench/sleep_vs_memory_saver.py`):")
        w("1 GiB tensors, none kept (*idle*), or 8 GiB of them whose contents go to host memory and")
        w("come back beside 32 GiB whose contents go (*offload*).")
        w("")
        w("| case | emm: sleep / wake | torch_memory_saver: pause / resume | weights intact (emm / tms) |")
        w("| --- | ---: | ---: | --- |")
        for case in ["idle", "offload"]:
            e, m = t.get(f"{case}/emm", {}), t.get(f"{case}/tms", {})
            cell = lambda r: (f"{r['sleep_seconds'] * 1e3:.0f} ms / {r['wake_seconds'] * 1e3:.0f} ms"
                              if "sleep_seconds" in r else "not measured: " + r.get("not_measured", r.get("failed", "?"))[:120])
            ok = lambda r: "yes" if r.get("weights_intact") else "no"
            intact = "no weights" if case == "idle" else f"{ok(e)} / {ok(m)}"
            w(f"| {case} | {cell(e)} | {cell(m)} | {intact} |")
        w("")
        exits = sorted({(k.split("/")[1], r["exit_status"], r["exit_error"].strip())
                        for k, r in t.items() if "exit_status" in r})
        for who, status, err in exits:
            name = "torch_memory_saver" if who == "tms" else "emm"
            w(f"{name}'s processes exited with status {status} after their figures were taken: `{err}`.")
        if exits:
            w("")

# ---- callgrind ----------------------------------------------------------------------------
w("## Instruction counts (checked in CI)")
w("")
w("`cargo bench -p emm --bench callgrind` counts instructions of 1 000 pairs of each hot path on")
w("the simulator (valgrind through gungraun). They are deterministic, so `.ci/run` fails a change")
w("that raises one past its budget, and fails when the default manager's bookkeeping (its pair")
w("minus the simulator making the same driver calls) passes 400 instructions a pair. Its log")
w("prints every count.")
open(os.path.join(root, "BENCHMARKS.md"), "w").write("\n".join(out) + "\n")

# ---- the plot: latency per size per subject, log-log, as SVG --------------------------------
series = {}
for r in pair_src:
    if r["section"] == "pair" and r["param"].isdigit() and r["subject"] in subjects:
        series.setdefault(r["subject"], []).append((int(r["param"]), float(r["value"])))
peer_run = " (call 2)" if host_run else ""
for name, label in (("pytorch", f"PyTorch (Python){peer_run}"), ("cupy", f"CuPy (Python){peer_run}")):
    series[label] = [(int(r[2]), float(r[4])) for r in peers if len(r) > 4 and r[1] == name]
W, H, L, B = 760, 420, 70, 50
xs = [x for pts in series.values() for x, _ in pts]
ys = [y for pts in series.values() for _, y in pts]
x0, x1 = math.log2(min(xs)), math.log2(max(xs))
y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
px = lambda x: L + (math.log2(x) - x0) / (x1 - x0) * (W - L - 190)
py_ = lambda y: H - B - (math.log10(y) - y0) / (y1 - y0) * (H - B - 20)
colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<rect width="{W}" height="{H}" fill="white"/>']
for e in range(y0, y1 + 1):
    y = py_(10 ** e)
    svg.append(f'<line x1="{L}" x2="{W - 190}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
    svg.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{ns(10 ** e)}</text>')
for x in sorted(set(xs)):
    svg.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" text-anchor="middle">{size(x)}</text>')
svg.append(f'<text x="{(L + W - 190) / 2}" y="{H - 12}" text-anchor="middle">allocation size</text>')
svg.append(f'<text x="14" y="{(H - B) / 2}" transform="rotate(-90 14 {(H - B) / 2})" text-anchor="middle">alloc + free pair, median</text>')
for i, (name, pts) in enumerate(series.items()):
    c = colours[i % len(colours)]
    pts = sorted(pts)
    svg.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(c, " ".join(f"{px(x):.1f},{py_(y):.1f}" for x, y in pts)))
    svg.append(f'<rect x="{W - 180}" y="{24 + 18 * i}" width="12" height="3" fill="{c}"/>')
    svg.append(f'<text x="{W - 162}" y="{29 + 18 * i}">{name}</text>')
svg.append("</svg>")
open(os.path.join(root, "bench-results", "pair-latency.svg"), "w").write("\n".join(svg) + "\n")
print(f"BENCHMARKS.md: {len(out)} lines; bench-results/pair-latency.svg")
