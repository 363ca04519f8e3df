#!/usr/bin/env bash
# The GPU benchmark, run from a bundle made by `cargo run -p ci -- gpu-bundle DIR`: bench_gpu
# (raw driver, driver pool, every emm manager) and then bench_peers.py (PyTorch, CuPy) on the
# same GPU, one after the other. Results: $EMM_BENCH_OUT (default DIR/bench): bench.csv,
# machine.txt, bench.err. Benchmarks, not tests: nothing here passes or fails on a number.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${EMM_BENCH_OUT:-$here/bench}
mkdir -p "$out"
{
    date -u +%Y-%m-%dT%H:%MZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nproc
} >"$out/machine.txt" 2>&1
EMM_DRIVER=cuda EMM_BENCH_DIR="$out" "$here/bin/bench_gpu" >"$out/bench.csv" 2>"$out/bench.err"
rc=$?
python3 "$here/bench_peers.py" >>"$out/bench.csv" 2>>"$out/bench.err" || rc=1
echo "bench: exit $rc, $(($(wc -l <"$out/bench.csv") - 1)) measurements in $out/bench.csv"
exit $rc
