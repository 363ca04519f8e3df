#!/usr/bin/env bash
# The Python half of the GPU job: the emm wheel's tests with Numba, CuPy and PyTorch, then
# numba-cuda's own cudadrv and test_ipc tests with Numba's manager and with emm.numba under
# emm's default and pool managers. Run from the repository root on the GPU machine, with
# WHEELS naming a folder that holds the emm wheel (`cd python && maturin build --release -o
# DIR`), numpy 2.3.5 for CPython 3.12 (numba-cuda 0.30.4 does not compile kernels with numpy
# 2.5) and the filecheck wheel numba-cuda's tests import. Logs go to $OUT (default /tmp).
set -u
wheels=${WHEELS:?set WHEELS to the folder of the emm, numpy and filecheck wheels}
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/np \
    "$wheels"/numpy-*.whl "$wheels"/filecheck-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    "$wheels"/emm-*.whl || exit 1
export PYTHONPATH=/tmp/np:/tmp/site
status=0
(cd python && EMM_PYTHON_DRIVER=cuda EMM_REQUIRE_GPU=1 python3 -m pytest -q -rs \
    -p no:cacheprovider tests) || status=1
mods="numba.cuda.tests.cudadrv numba.cuda.tests.cudapy.test_ipc"
for setup in "NUMBA_CUDA_MEMORY_MANAGER=default" \
    "NUMBA_CUDA_MEMORY_MANAGER=emm.numba EMM_MEMORY_MANAGER=default" \
    "NUMBA_CUDA_MEMORY_MANAGER=emm.numba EMM_MEMORY_MANAGER=pool"; do
    name=$(echo "$setup" | tr ' =' '_-')
    env $setup timeout 300 python3 -m numba.runtests -v $mods >"$out/numba-$name.log" 2>&1
    echo "== $setup: $(grep -E '^Ran [0-9]+ tests' "$out/numba-$name.log") $(grep -E '^(OK|FAILED)' "$out/numba-$name.log" | tail -1)"
    grep -E '^(ERROR|FAIL):' "$out/numba-$name.log"
done
exit $status
