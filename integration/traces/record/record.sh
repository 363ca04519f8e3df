#!/usr/bin/env bash
# Records the trace corpus on a GPU through emm's `log` adaptor and measures, in the same run,
# what other allocators hold on the traces. Run from the repository root on the GPU machine:
#
#   WHEELS=DIR OUT=DIR [REPLAY=path/to/replay] bash integration/traces/record/record.sh
#
# WHEELS holds the emm wheel, numpy 2.3.5 (numba-cuda's kernels do not compile with numpy 2.5)
# and RMM's wheels (rmm-cu13, librmm-cu13, rapids-logger). REPLAY is the replay example built
# with `cargo build --release -p integration --example replay` (optional: emm's managers on
# the GPU). Everything lands in OUT/corpus.tar: the gzipped traces, results.jsonl (one JSON
# object per run or replay) and each run's output.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:?set OUT to a folder for the results}
wheels=${WHEELS:?set WHEELS to the folder of the wheels}
t=$out/traces
mkdir -p "$t"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    "$wheels"/emm-*.whl "$wheels"/rmm_cu13-*.whl "$wheels"/librmm_cu13-*.whl \
    "$wheels"/rapids_logger-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/np \
    "$wheels"/numpy-*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
results=$out/results.jsonl
: >"$results"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1

# run NAME ENV... -- CMD...: runs CMD with ENV, keeps its output and its RESULT line.
run() {
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local start=$SECONDS
    env "${envs[@]}" timeout 200 "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s"
    grep '^RESULT ' "$out/$name.txt" | sed "s/^RESULT {/{\"run\": \"$name\", \"exit\": $rc, /" >>"$results"
}

# record NAME [ENV...] -- CMD...: records CMD's allocations through emm (async-pool) as
# traces/NAME.csv.gz.
record() {
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    run "$name.emm" EMM_MEMORY_MANAGER=async-pool EMM_MEMORY_ADAPTORS="stats,log=$t/$name.csv" \
        "${envs[@]}" -- "$@" --allocator emm
    gzip -9 -f "$t/$name.csv"
}

cd "$here"
numba=(PYTHONPATH=/tmp/np:/tmp/site NUMBA_CUDA_MEMORY_MANAGER=emm.numba)
record torch_transformer -- python3 torch_transformer.py --steps 100
record torch_cnn -- python3 torch_cnn.py --steps 100
record llm_inference -- python3 llm_inference.py --steps 16
record cupy_work -- python3 cupy_work.py --steps 100
record numba_pipeline "${numba[@]}" -- python3 numba_pipeline.py --steps 100
record rmm_random -- python3 rmm_random.py --steps 10000

# The same programs on the frameworks' own allocators: results to compare, memory figures.
for w in torch_transformer torch_cnn llm_inference; do
    steps=$([ $w = llm_inference ] && echo 16 || echo 100)
    run "$w.native" X=1 -- python3 $w.py --steps "$steps" --allocator native
    run "$w.expandable" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- \
        python3 $w.py --steps "$steps" --allocator native
done
run cupy_work.native X=1 -- python3 cupy_work.py --steps 100 --allocator native

# The traces replayed through the other allocators, and through emm's managers.
for a in torch torch-expandable cupy rmm-pool rmm-arena rmm-async; do
    run "replay.$a" X=1 -- python3 replay_frameworks.py --allocator "$a" "$t"/*.csv.gz
done
if [ -n "${REPLAY:-}" ]; then
    run replay.emm X=1 -- "$REPLAY" --driver cuda --manager default,pool,async-pool \
        --csv "$out/emm-cuda.csv" "$t"/*.csv.gz
fi
# Facts of the driver's virtual memory management on this GPU.
run vmm-facts X=1 -- python3 -c '
import json
from cuda.bindings import driver as d
d.cuInit(0)
_, dev = d.cuDeviceGet(0)
A = d.CUdevice_attribute
attr = lambda a: d.cuDeviceGetAttribute(a, dev)[1]
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
G = d.CUmemAllocationGranularity_flags
print("RESULT " + json.dumps({
  "vmm": attr(A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
  "posix_fd": attr(A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
  "granularity_min": int(d.cuMemGetAllocationGranularity(prop, G.CU_MEM_ALLOC_GRANULARITY_MINIMUM)[1]),
  "granularity_recommended": int(d.cuMemGetAllocationGranularity(prop, G.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)[1]),
}))'
cd "$out" && tar -cf corpus.tar traces results.jsonl gpu.txt ./*.txt $(ls emm-cuda.csv 2>/dev/null)
echo "corpus: $(du -sh "$t" | cut -f1) of traces; $(wc -l <"$results") results"
