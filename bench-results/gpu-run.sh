#!/usr/bin/env bash
# One benchmark run for BENCHMARKS.md on the GPU machine, in three device calls (each under the
# device tool's 10 minutes), from the repository root there. Carry the bundle
# (`cargo run -p ci -- gpu-bundle .gpu/bundle`; BUNDLE names another folder, such as one that
# holds only its bench-gpu.sh, bench_peers.py, bin/bench_gpu and bin/replay, to stay within
# what a call carries), the wheel (`cd python && maturin build
# --release -o ../.gpu/wheel`) and RMM's wheels in .gpu/rmm (rmm-cu13, librmm-cu13 and
# rapids-logger, as gpu-runner.md names them):
#
#     bash bench-results/gpu-run.sh 1    # bench_gpu (cut at 300 s), the corpus replays
#     bash bench-results/gpu-run.sh 2    # the Python pairs, cupy_ab.py, quick bench_gpu, peers
#     bash bench-results/gpu-run.sh 3    # PyTorch's pool and emm.torch, alternate processes;
#                                         # then the corpus's training loop, three rounds
#
# PyTorch takes its allocator once per process, so the two cannot be interleaved in one as
# cupy_ab.py interleaves CuPy's; call 3 alternates their processes for eight rounds. A
# process lands in a fast or a slow phase of the host, which adds up to 2 x to its figures:
# the page compares the fastest process of each.
#
# Each call leaves one archive, $OUT/call-N.tar.gz (a device call returns a few files only);
# unpack them into bench-results/run-DATE-GPU-COMMIT/, write its run.txt, and run
# make_benchmarks.py on it.
set -u
bundle=${BUNDLE:-.gpu/bundle}
part=${1:?which call: 1, 2 or 3}
out=${OUT:?the device tool sets OUT}/call-$part
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/wheel/*.whl .gpu/rmm/*.whl || exit 1
export PYTHONPATH=/tmp/site EMM_MEMORY_MANAGER=pool
start=$SECONDS
case $part in
1)
    EMM_BENCH_OUT=$out/bench timeout 300 bash "$bundle/bench-gpu.sh"
    cp "$out/bench/bench.csv" "$out/bench-full.csv"
    for a in torch torch-expandable cupy rmm-pool rmm-arena rmm-async; do
        python3 integration/traces/record/replay_frameworks.py --allocator "$a" integration/traces/*.csv.gz \
            >>"$out/corpus-frameworks.jsonl" 2>>"$out/corpus-frameworks.err"
    done
    "$bundle/bin/replay" --driver cuda --manager default,pool,vmm-pool,async-pool,async-pool-ipc,async-pool-managed \
        --csv "$out/corpus-emm.csv" integration/traces/*.csv.gz >"$out/corpus-emm.txt" 2>&1
    ;;
2)
    cc -O2 -shared -fPIC -o /tmp/libcfloor.so python/bench/cfloor.c
    export EMM_BENCH_CFLOOR=/tmp/libcfloor.so
    python3 python/bench/bench_alloc.py >"$out/python.jsonl" 2>"$out/python.err"
    (cd python/bench && python3 cupy_ab.py 41) >"$out/cupy-ab.jsonl" 2>"$out/cupy-ab.err"
    EMM_DRIVER=cuda EMM_BENCH_QUICK=1 EMM_BENCH_ONLY=threads,random,random-pool,pinned,copy,stream,default \
        "$bundle/bin/bench_gpu" >"$out/bench-quick.csv" 2>"$out/bench-quick.err"
    python3 "$bundle/bench_peers.py" >"$out/peers.csv" 2>"$out/peers.err"
    ;;
3)
    for round in 1 2 3 4 5 6 7 8; do
        for config in torch torch-emm; do
            python3 python/bench/bench_alloc.py "$config" |
                sed "s/^{/{\"round\": $round, /" >>"$out/python-rounds.jsonl" 2>>"$out/python-rounds.err"
        done
    done
    # The transformer training loop under PyTorch's allocator (with and without expandable
    # segments), `pool` and `vmm-pool`, one process each in turn, three rounds.
    for round in 1 2 3; do
        python3 integration/traces/record/compare_training.py --steps 100 --managers pool,vmm-pool \
            >"$out/training-$round.txt" 2>&1
        sed -n "s/^COMPARE {/{\"round\": $round, /p" "$out/training-$round.txt" >>"$out/training.jsonl"
    done
    ;;
*)
    echo "call 1, 2 or 3, not $part" >&2
    exit 2
    ;;
esac
echo "call $part: $((SECONDS - start)) s" | tee "$out/seconds.txt"
tar -czf "$OUT/call-$part.tar.gz" -C "$OUT" "call-$part" && rm -rf "$out"
