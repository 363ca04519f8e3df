"""Draws BENCHMARKS.md's plot from a bench_gpu CSV: alloc + free latency per size per manager.
python3 bench-results/plot.py bench-results/h200-2026-11-22.csv bench-results/pair-latency.png"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["section"] == "pair"]
subjects = []
for r in rows:
    if r["subject"] not in subjects:
        subjects.append(r["subject"])
fig, ax = plt.subplots(figsize=(9, 5.5))
for s in subjects:
    pts = sorted((int(r["param"]), float(r["value"])) for r in rows if r["subject"] == s)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("allocation size (bytes)")
ax.set_ylabel("alloc + free pair, median (ns)")
ax.set_title("Alloc + free latency per size, NVIDIA H200, one process (bench_gpu + bench_peers.py)")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
