#!/usr/bin/env bash
# The Python half of the GPU job: the emm wheel's tests with Numba, CuPy and PyTorch, the real
# programs (`run-programs.sh`), then numba-cuda's own suite (cudadrv and cudapy, `numba-suite.sh`) with Numba's manager and with
# emm.numba under emm's default and pool managers. Run from the repository root on the GPU machine, with
# WHEELS naming a folder that holds the emm wheel (`cd python && maturin build --release -o
# DIR`), numpy 2.3.5 for CPython 3.12 (numba-cuda 0.30.4 does not compile kernels with numpy
# 2.5), the filecheck wheel numba-cuda's tests import, and optionally cffi and pycparser. Logs go to $OUT (default /tmp).
set -u
wheels=${WHEELS:?set WHEELS to the folder of the emm, numpy and filecheck wheels}
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/np \
    "$wheels"/numpy-*.whl "$wheels"/filecheck-*.whl || exit 1
# cffi (with pycparser), when carried, lets numba-cuda's cffi-using test modules load.
for w in "$wheels"/cffi-*.whl "$wheels"/pycparser-*.whl; do
    [ -e "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target /tmp/np "$w"
done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    "$wheels"/emm-*.whl || exit 1
export PYTHONPATH=/tmp/np:/tmp/site
# distributed, dask-cuda and their pure-Python dependencies (DIR/wheels/dask, which the GPU
# workflow's bundle job downloads): test_dask_gpu.py fails under EMM_REQUIRE_GPU=1 without them.
if compgen -G "$wheels/dask/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/dask \
        "$wheels"/dask/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/dask
fi
# Ray and its dependencies (DIR/wheels/ray, from the same job): test_ray_gpu.py fails under
# EMM_REQUIRE_GPU=1 without them.
if compgen -G "$wheels/ray/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/ray \
        "$wheels"/ray/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/ray
fi
status=0
(cd python && EMM_PYTHON_DRIVER=cuda EMM_REQUIRE_GPU=1 python3 -m pytest -q -rs \
    -p no:cacheprovider tests) || status=1
# The corpus's transformer training loop through emm.torch under each manager against PyTorch's
# own allocator: bit-identical losses, and the memory each held beside PyTorch's reserve.
(cd integration/traces/record && EMM_PYTHON_DRIVER=cuda python3 compare_training.py \
    --managers default,pool,vmm-pool,async-pool,async-pool-ipc) >"$out/compare-training.txt" 2>&1 || status=1
cat "$out/compare-training.txt"
# Real programs on the GPU under PyTorch's allocator and emm's pools: the memory section of
# BENCHMARKS.md (`run-programs.sh`; fails when a run fails or its results differ).
OUT=$out bash "$(dirname "$0")/run-programs.sh" || status=1
# numba-cuda's whole suite under Numba's manager and under emm.numba (default, pool): fails when
# a test fails under emm.numba and not under Numba's own manager.
OUT=$out bash "$(dirname "$0")/numba-suite.sh" || status=1
exit $status
