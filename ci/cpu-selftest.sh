#!/usr/bin/env bash
# A self-test of `.ci/run`, with no build: the job runs with stub tools (EMM_CI_STUB=1), once
# with every stub passing (the job must pass), then once for each call a stub printed, with
# that one call failing (EMM_CI_FAIL_STEP, EMM_CI_FAIL_CALL): the job must exit non-zero, and
# the last step it started must be the call's. A status the script does not check (a command
# not last in an `&&` list under `set -e`, a pipeline's first command, a background lane's
# exit) fails this test. Calls whose output the script captures or discards (a version probe
# that decides whether to install a tool) print nothing and are not failed here: their failure
# is handled by design. `.ci/run` runs this.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
failures=0

run_job() {
    EMM_CI_STUB=1 EMM_CI_FAIL_STEP="$1" EMM_CI_FAIL_CALL="$2" PROPTEST_RNG_SEED=1 \
        bash "$here/.ci/run" 2>&1
}

out=$(run_job "" "")
rc=$?
if [ "$rc" -ne 0 ] || ! grep -q "^==> CPU job passed" <<<"$out"; then
    echo ".ci/run self-test FAILED: with every stub passing the job exits $rc:"
    tail -n 20 <<<"$out"
    exit 1
fi
mapfile -t headings < <(grep '^==> ' <<<"$out")
mapfile -t calls < <(sed -n 's/^stub (step \([0-9]*\)): \(.*\)$/\1\t\2/p' <<<"$out" | sort -u -t$'\t' -k1,1n -k2)
echo ".ci/run self-test: ${#headings[@]} steps and ${#calls[@]} tool calls pass with stubs"
steps_failed=()
for entry in "${calls[@]}"; do
    k=${entry%%$'\t'*}
    call=${entry#*$'\t'}
    got=$(run_job "$k" "$call")
    rc=$?
    last=$(grep '^==> ' <<<"$got" | tail -n 1)
    want=${headings[k - 1]}
    if [ "$rc" -eq 0 ] || [ "$last" != "$want" ]; then
        echo ".ci/run self-test FAILED: \`$call\` failing in step $k (${want#==> }): job exit $rc, last step started: ${last#==> }"
        tail -n 15 <<<"$got"
        failures=$((failures + 1))
    fi
    steps_failed[k]=1
done
for ((k = 1; k < ${#headings[@]}; k++)); do
    if [ -z "${steps_failed[k]:-}" ]; then
        echo ".ci/run self-test FAILED: step $k (${headings[k - 1]#==> }) calls no tool a stub could fail"
        failures=$((failures + 1))
    fi
done
if [ "$failures" -ne 0 ]; then
    echo ".ci/run self-test: $failures failure(s) that do not fail the job as they should"
    exit 1
fi
echo ".ci/run self-test: each of ${#calls[@]} tool calls, failing, fails the job in its step"
