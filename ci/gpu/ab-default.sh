#!/bin/bash
# A/B of the default manager's pair on the simulated driver (emm's bookkeeping plus the
# simulator's cost), two builds of bench_gpu taking turns; the 256 B rows only.
#
# Usage: ab-default.sh DIR A B ROUNDS OUT
#   DIR holds bench_gpu_A and bench_gpu_B (each a stripped `bench_gpu` of one commit);
#   OUT gets one CSV line per row: round,build,subject,ns_per_pair.
set -euo pipefail
dir=$1 a=$2 b=$3 rounds=$4 out=$5
echo "round,build,subject,ns_per_pair" > "$out"
for r in $(seq 1 "$rounds"); do
  for build in "$a" "$b"; do
    EMM_DRIVER=sim EMM_BENCH_ONLY=default "$dir/bench_gpu_$build" 2>/dev/null \
      | grep ',256,1,' | grep -v peak \
      | awk -F, -v r="$r" -v b="$build" '{print r "," b "," $2 "," $5}' >> "$out"
  done
done
