"""Prints BENCHMARKS.md's table of memory held on the trace corpus, from one GPU run's files:
peak device memory held over peak live bytes, per trace and allocator.

    python3 bench-results/held_table.py

Every figure is the device memory `cudaMemGetInfo` counts as used, read after each allocation,
over what the process used before the trace; `async-pool-managed`'s is its pool's own peak
(`pool_peak_held_bytes`), since managed memory not yet resident on the device is not counted
as used there.
"""

import csv
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
RUN = "h100-2026-11-27-corpus-{}-8386f46"
FRAMEWORKS = RUN.format("frameworks") + ".jsonl"
EMM = RUN.format("emm-cuda") + ".csv"

cols = [
    ("PyTorch", "torch"),
    ("PyTorch expandable", "torch-expandable"),
    ("CuPy pool", "cupy"),
    ("RMM pool", "rmm-pool"),
    ("RMM arena", "rmm-arena"),
    ("RMM async", "rmm-async"),
    ("emm default", "default"),
    ("emm pool", "pool"),
    ("emm vmm-pool", "vmm-pool"),
    ("emm async-pool", "async-pool"),
    ("emm async-pool-ipc", "async-pool-ipc"),
    ("emm async-pool-managed", "async-pool-managed"),
]
table = {}
for line in open(os.path.join(here, FRAMEWORKS)):
    if line.startswith("RESULT "):
        r = json.loads(line[len("RESULT "):])
        table[(r["trace"], r["allocator"])] = r["held_over_live"]
for r in csv.DictReader(open(os.path.join(here, EMM))):
    held = int(r["peak_held_bytes"])
    if r["manager"] == "async-pool-managed":
        held = int(r["pool_peak_held_bytes"])
    table[(r["trace"], r["manager"])] = held / int(r["peak_live_bytes"])
traces = sorted({t for t, _ in table})
print("| trace | " + " | ".join(c for c, _ in cols) + " |")
print("| --- |" + " ---: |" * len(cols))
for t in traces:
    cells = []
    for _, a in cols:
        v = table.get((t, a))
        cells.append("-" if v is None else f"{v:.3f}")
    print(f"| {t} | " + " | ".join(cells) + " |")
