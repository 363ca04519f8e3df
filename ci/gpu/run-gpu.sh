#!/usr/bin/env bash
# The emm GPU job, run from a bundle made by `cargo run -p ci -- gpu-bundle DIR` on the build
# machine. It builds nothing. Every test binary runs with EMM_REQUIRE_GPU=1, so a missing GPU
# fails the job instead of skipping; the full log goes to $EMM_GPU_LOG (default
# DIR/gpu-job.log) and a short summary is printed last.
#
# Both halves run, and anything missing fails the job by name: every binary `bin/MANIFEST`
# lists (the bundle writes it), then the Python half (`ci/gpu/run-python.sh`, from the
# checkout at $EMM_REPO, default the working directory, with the wheels in DIR/wheels: the
# emm wheel, numpy and filecheck, which the GPU workflow's bundle job adds).
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=${EMM_REPO:-$PWD}
log=${EMM_GPU_LOG:-$here/gpu-job.log}
export EMM_REQUIRE_GPU=1
: >"$log"
status=0
summary=()

# run NAME CMD...: runs CMD, appends its output to the log, records its libtest result line.
run() {
    local name=$1; shift
    local out; out=$(mktemp)
    echo "=== $name: $*" >>"$log"
    "$@" >"$out" 2>&1
    local rc=$?
    cat "$out" >>"$log"
    local result; result=$(grep -E '^test result:' "$out" | tail -n 1)
    summary+=("$(printf '%-22s %s (exit %d)' "$name" "${result:-no test result line}" "$rc")")
    if [ "$rc" != 0 ]; then status=1; fi
    if [[ "$name" == "suite cuda"* ]]; then
        # Every CUDA test must run, except the multi-device ones on a one-GPU machine and the
        # tests a manager does not apply to, which the suite announces (EMM_REQUIRE_GPUS=2
        # turns the first into a failure).
        ignored=$(sed -nE 's/.*; ([0-9]+) ignored;.*/\1/p' <<<"$result")
        allowed=0
        for n in $(grep -oE 'the [0-9]+ multi-device CUDA tests are skipped|^note: [0-9]+ cuda tests are ignored under the memory manager' "$out" | grep -oE '[0-9]+'); do
            allowed=$((allowed + n))
        done
        if [ "${ignored:-1}" != "${allowed:-0}" ]; then
            summary+=("suite cuda: ${ignored:-?} CUDA tests were ignored, ${allowed:-0} allowed; the GPU job requires all to run")
            status=1
        fi
    fi
    rm -f "$out"
}

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >>"$log" 2>&1 || true
# Every binary the bundle was made with must be here.
listed=()
if [ ! -f "$here/bin/MANIFEST" ]; then
    summary+=("bundle                 FAILED: bin/MANIFEST is missing (make the bundle with cargo run -p ci -- gpu-bundle)")
    status=1
else
    mapfile -t listed <"$here/bin/MANIFEST"
    for b in "${listed[@]}"; do
        if [ ! -x "$here/bin/$b" ]; then
            summary+=("$(printf '%-22s FAILED: bin/%s is listed in bin/MANIFEST but missing (rebuild the bundle)' "$b" "$b")")
            status=1
        fi
    done
fi
run "suite sim" "$here/bin/suite" --test-threads 2 sim::
# The stress test at full size on the GPU: a million operations on 16 threads.
export EMM_STRESS_OPS=${EMM_GPU_STRESS_OPS:-1000000}
run "suite cuda" "$here/bin/suite" --test-threads 1 cuda::
unset EMM_STRESS_OPS
# The suite again under every other manager, and under adaptors and the pinned host pool.
EMM_MEMORY_MANAGER=pool run "suite cuda pool" "$here/bin/suite" --test-threads 1 cuda::
EMM_MEMORY_MANAGER=vmm-pool run "suite cuda vmm-pool" "$here/bin/suite" --test-threads 1 cuda::
EMM_MEMORY_MANAGER=async-pool run "suite cuda async-pool" "$here/bin/suite" --test-threads 1 cuda::
EMM_MEMORY_MANAGER=async-pool-ipc run "suite cuda async-pool-ipc" "$here/bin/suite" --test-threads 1 cuda::
EMM_MEMORY_MANAGER=async-pool-managed run "suite cuda async-pool-managed" "$here/bin/suite" --test-threads 1 cuda::
EMM_MEMORY_MANAGER=pool EMM_MEMORY_ADAPTORS=limit=64GiB,stats,trace EMM_PINNED_HOST_POOL=on \
    run "suite cuda pool+adapt" "$here/bin/suite" --test-threads 1 cuda::
EMM_MEMORY_ADAPTORS=stats,log=$here/suite-log.csv EMM_PINNED_HOST_POOL=on \
    run "suite cuda default+adapt" "$here/bin/suite" --test-threads 1 cuda::

# The suite again under compute-sanitizer's memcheck with full leak checking: no memory error,
# no leak. API errors are not reported (the suite provokes them on purpose: out-of-memory,
# double frees). Three conformance tests let a context destroy live memory on purpose, which the
# leak checker reports by design; they are skipped here. No kernels are launched, so racecheck
# has nothing to check. EMM_SKIP_SANITIZER=1 skips the step (and says so).
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "${EMM_SKIP_SANITIZER:-0}" = 1 ]; then
    summary+=("memcheck               SKIPPED (EMM_SKIP_SANITIZER=1)")
elif [ ! -x "$sanitizer" ]; then
    summary+=("memcheck               FAILED: compute-sanitizer not found (set EMM_SKIP_SANITIZER=1 to skip)")
    status=1
else
    out=$(mktemp)
    echo "=== memcheck" >>"$log"
    "$sanitizer" --tool memcheck --leak-check full --report-api-errors no --error-exitcode 99 \
        "$here/bin/suite" --test-threads 1 cuda:: \
        --skip released_context_is_destroyed --skip reset_destroys_context_until_retained \
        --skip context_destruction_reclaims_all_its_memory \
        >"$out" 2>&1
    rc=$?
    cat "$out" >>"$log"
    errors=$(grep -E '^========= ERROR SUMMARY' "$out" | tail -n 1)
    leaks=$(grep -E '^========= LEAK SUMMARY' "$out" | tail -n 1)
    result=$(grep -E '^test result:' "$out" | tail -n 1)
    summary+=("$(printf '%-22s %s; %s; %s (exit %d)' memcheck "${result:-no test result line}" "${errors#========= }" "${leaks:-no leaks reported}" "$rc")")
    [ "$rc" = 0 ] || status=1
    rm -f "$out"
fi
# Every library's and test target's binary the manifest lists (a missing one failed above).
tests=0
for b in "${listed[@]}"; do
    case "$b" in
        unit-* | test-*)
            tests=$((tests + 1))
            [ -x "$here/bin/$b" ] && run "$b" "$here/bin/$b"
            ;;
    esac
done
if [ "$tests" = 0 ]; then
    summary+=("unit and test binaries  FAILED: bin/MANIFEST lists none (rebuild the bundle)")
    status=1
fi
# A soak, shorter than a manual one: every manager in turn, the stress workload and an IPC
# round trip to a child process each round, device memory back to the byte every round, host
# resident memory flat (EMM_GPU_SOAK_SECONDS, default 60; docs/testing.md says how to run longer).
# The soak and the examples are part of the bundle: one missing fails the job.
if [ ! -x "$here/bin/soak" ]; then
    summary+=("$(printf '%-22s FAILED: bin/soak is not in the bundle (rebuild it)' soak)"); status=1
else
    echo "=== soak" >>"$log"
    out=$(mktemp)
    EMM_DRIVER=cuda EMM_SOAK_SECONDS=${EMM_GPU_SOAK_SECONDS:-60} "$here/bin/soak" >"$out" 2>&1
    rc=$?
    cat "$out" >>"$log"
    summary+=("$(printf '%-22s %s (exit %d)' soak "$(grep -E '^soak: [0-9]+ rounds' "$out" | tail -n 1)" "$rc")")
    [ "$rc" = 0 ] || status=1
    rm -f "$out"
fi
for ex in quickstart driver_probe array_kernel graph_kernel; do
    if [ ! -x "$here/bin/$ex" ]; then
        summary+=("$(printf '%-22s FAILED: bin/%s is not in the bundle (rebuild it)' "$ex" "$ex")"); status=1
    else
        echo "=== $ex" >>"$log"
        if EMM_DRIVER=cuda EMM_REQUIRE_GPU=1 "$here/bin/$ex" >>"$log" 2>&1; then
            summary+=("$(printf '%-22s ok' "$ex")")
        else
            summary+=("$(printf '%-22s FAILED' "$ex")"); status=1
        fi
    fi
done

# The Python half: the wheel's tests with Numba, CuPy and PyTorch, the training loop, the real
# programs and numba-cuda's suite (`ci/gpu/run-python.sh`).
if ! compgen -G "$here/wheels/emm-*.whl" >/dev/null; then
    summary+=("python                 FAILED: no emm wheel in $here/wheels (the GPU workflow's bundle job builds it: cd python && maturin build --release -o DIR/wheels)")
    status=1
elif [ ! -f "$repo/ci/gpu/run-python.sh" ]; then
    summary+=("python                 FAILED: no checkout at $repo (set EMM_REPO to the repository the bundle was made from)")
    status=1
else
    echo "=== python" >>"$log"
    pyout=$(mktemp -d)
    (cd "$repo" && WHEELS="$here/wheels" OUT="$pyout" bash ci/gpu/run-python.sh) >>"$log" 2>&1
    rc=$?
    summary+=("$(printf '%-22s exit %d (run-python.sh; its pytest, training, programs and numba-cuda results are in the log)' python "$rc")")
    [ "$rc" = 0 ] || status=1
fi

echo "full log: $log"
echo "---- emm GPU job summary ----"
printf '%s\n' "${summary[@]}"
if [ "$status" = 0 ]; then echo "GPU job: PASS"; else echo "GPU job: FAIL"; fi
exit "$status"
