#!/bin/bash
# A/B of the default manager's pair on the simulated driver (emm's bookkeeping plus the
# simulator's cost), two builds of bench_gpu taking turns (`ab.sh`); the 256 B rows only.
#
# Usage: ab-default.sh DIR A B ROUNDS OUT
#   DIR holds bench_gpu_A and bench_gpu_B (each a stripped `bench_gpu` of one commit);
#   OUT gets one CSV line per row: round,build,subject,ns_per_pair.
set -euo pipefail
dir=$1 a=$2 b=$3 rounds=$4 out=$5
all=$(mktemp)
AB_QUICK=0 bash "$(dirname "$0")/ab.sh" "$dir" "$a" "$b" "$rounds" "$all" default sim
echo "round,build,subject,ns_per_pair" > "$out"
grep ',256,1,' "$all" | grep -v peak | awk -F, '{print $1 "," $2 "," $4 "," $7}' >> "$out"
rm -f "$all"
