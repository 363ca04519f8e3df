#!/bin/bash
# A/B of two builds of bench_gpu taking turns in one process tree, so that both see the same
# phases of the host: each round runs build A, then build B, on the same sections.
#
# Usage: ab.sh DIR A B ROUNDS OUT SECTIONS [DRIVER]
#   DIR holds bench_gpu_A and bench_gpu_B (each a stripped `bench_gpu` of one commit);
#   SECTIONS is EMM_BENCH_ONLY's list (e.g. pair,pinned); DRIVER is EMM_DRIVER (cuda, or sim
#   for the simulated driver; default cuda). Runs are quick (EMM_BENCH_QUICK=1) unless
#   AB_QUICK=0.
#   OUT gets one CSV line per row: round,build, then bench_gpu's own columns.
set -euo pipefail
dir=$1 a=$2 b=$3 rounds=$4 out=$5 sections=$6 driver=${7:-cuda} quick=${AB_QUICK:-1}
echo "round,build,section,subject,param,threads,value,unit" > "$out"
for r in $(seq 1 "$rounds"); do
  for build in "$a" "$b"; do
    EMM_DRIVER=$driver EMM_BENCH_QUICK=$quick EMM_BENCH_ONLY=$sections "$dir/bench_gpu_$build" \
      2>/dev/null | tail -n +2 | sed "s/^/$r,$build,/" >> "$out"
  done
done
