#!/usr/bin/env bash
# A self-test of run-gpu.sh, with no GPU: stub binaries that pass, in a bundle laid out as
# `cargo run -p ci -- gpu-bundle` lays it out, and a stub checkout whose run-python.sh passes.
# The whole bundle passes; then each thing the job needs is taken away in turn (a binary the
# manifest lists, the manifest, the test binaries, the wheel, the checkout) or made to fail
# (a test binary, the Python half), and the job must fail and name it. `.ci/run` runs this.
set -u
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# A stub executable at $1 that prints a passing libtest result line and exits with $2.
stub() {
    printf '#!/usr/bin/env bash\necho "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s"\necho "soak: 1 rounds"\nexit %s\n' "$2" >"$1"
    chmod +x "$1"
}

# A fresh passing bundle in $work/b and checkout in $work/repo.
make_bundle() {
    rm -rf "$work/b" "$work/repo"
    mkdir -p "$work/b/bin" "$work/b/wheels" "$work/repo/ci/gpu"
    cp "$here/run-gpu.sh" "$work/b/"
    for b in suite soak quickstart driver_probe array_kernel graph_kernel unit-emm test-behaviour; do
        stub "$work/b/bin/$b" 0
    done
    printf '%s\n' suite soak quickstart driver_probe array_kernel graph_kernel unit-emm test-behaviour \
        >"$work/b/bin/MANIFEST"
    : >"$work/b/wheels/emm-0.1.0-cp311-abi3-manylinux_2_34_x86_64.whl"
    printf '#!/usr/bin/env bash\necho "1 passed"\nexit 0\n' >"$work/repo/ci/gpu/run-python.sh"
}

# expect NAME WANT_RC PATTERN: runs the job on the bundle; its exit status must be WANT_RC and
# its output must match PATTERN.
expect() {
    local out rc
    out=$(EMM_SKIP_SANITIZER=1 EMM_REPO="$work/repo" EMM_GPU_LOG="$work/log" bash "$work/b/run-gpu.sh" 2>&1)
    rc=$?
    if [ "$rc" != "$2" ] || ! grep -qE "$3" <<<"$out"; then
        echo "run-gpu.sh self-test FAILED: $1: exit $rc (want $2), output did not match /$3/:"
        echo "$out" | tail -n 20
        failures=$((failures + 1))
    else
        echo "run-gpu.sh self-test: $1: exit $rc as it should"
    fi
}

make_bundle
expect "everything present" 0 "GPU job: PASS"
make_bundle; rm "$work/b/bin/test-behaviour"
expect "a listed test binary missing" 1 "bin/test-behaviour is listed in bin/MANIFEST but missing"
make_bundle; rm "$work/b/bin/MANIFEST"
expect "the manifest missing" 1 "bin/MANIFEST is missing"
make_bundle; printf '%s\n' suite soak quickstart driver_probe array_kernel graph_kernel >"$work/b/bin/MANIFEST"
expect "no test binaries listed" 1 "lists none"
make_bundle; stub "$work/b/bin/unit-emm" 1
expect "a failing test binary" 1 "GPU job: FAIL"
make_bundle; rm "$work/b/bin/soak"
expect "the soak missing" 1 "soak"
make_bundle; rm "$work/b/wheels/"*.whl
expect "the wheel missing" 1 "no emm wheel"
make_bundle; rm -r "$work/repo/ci"
expect "the checkout missing" 1 "no checkout at"
make_bundle; printf '#!/usr/bin/env bash\nexit 1\n' >"$work/repo/ci/gpu/run-python.sh"
expect "the Python half failing" 1 "python +exit 1"
exit $((failures > 0))
