"""Prints BENCHMARKS.md's table of memory held on the trace corpus, from the run files named
below: peak device memory held over peak live bytes, per trace and allocator.

    python3 bench-results/held_table.py
"""

import csv
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
FRAMEWORKS = "h200-2026-11-27-corpus-frameworks.jsonl"  # PyTorch, CuPy (H200, f4bdb83's run)
EMM_H200 = "h200-2026-11-27-corpus-emm-cuda-f4bdb83.csv"  # default, async-pool (H200)
EMM_H100 = "h100-2026-11-27-corpus-emm-cuda-378c180.csv"  # pool, vmm-pool (H100)

cols = [
    ("PyTorch", FRAMEWORKS, "torch"),
    ("PyTorch expandable", FRAMEWORKS, "torch-expandable"),
    ("CuPy pool", FRAMEWORKS, "cupy"),
    ("emm default", EMM_H200, "default"),
    ("emm async-pool", EMM_H200, "async-pool"),
    ("emm pool", EMM_H100, "pool"),
    ("emm vmm-pool", EMM_H100, "vmm-pool"),
]
table = {}
for line in open(os.path.join(here, FRAMEWORKS)):
    r = json.loads(line[len("RESULT "):] if line.startswith("RESULT ") else line)
    table[(r["trace"], FRAMEWORKS, r["allocator"])] = r["held_over_live"]
for name in (EMM_H200, EMM_H100):
    for r in csv.DictReader(open(os.path.join(here, name))):
        table[(r["trace"], name, r["manager"])] = float(r["held_over_live"])
traces = sorted({t for t, _, _ in table})
print("| trace | " + " | ".join(c for c, _, _ in cols) + " |")
print("| --- |" + " ---: |" * len(cols))
for t in traces:
    cells = []
    for _, f, a in cols:
        v = table.get((t, f, a))
        cells.append("-" if v is None else f"{v:.3f}")
    print(f"| {t} | " + " | ".join(cells) + " |")
