#!/usr/bin/env bash
# numba-cuda's whole CUDA suite (`numba.cuda.tests.cudadrv` and `numba.cuda.tests.cudapy`) three
# times: with Numba's own memory manager, and with `NUMBA_CUDA_MEMORY_MANAGER=emm.numba` under
# emm's `default` and `pool` managers. Run from the repository root on the GPU machine after the
# wheels are installed as `run-python.sh` installs them (PYTHONPATH=/tmp/np:/tmp/site).
#
# One serial pass of cudapy takes about 390 s on an H200, so the three configurations run at the
# same time, each split into SHARDS groups of test modules (round robin over the sorted module
# names; the same groups for every configuration), each group one `python3 -m numba.runtests -v`
# process. Logs: $OUT/numba-full-<config>.log (the groups' logs one after the other); the summary
# (tests run / ok / skipped / failed / errors / expected failures per configuration, then every
# failing test) is printed last and written to $OUT/numba-full-summary.txt.
#
# Running side by side disturbs a few tests (test_ipc's child once read another process's data,
# under Numba's own manager too), so every module with a failing test in the parallel pass runs
# again alone, one configuration after another; its result then counts. The script fails when a
# test fails under emm.numba (after the re-run) and not under Numba's own manager, unless the
# failure is one `explained` below lists with its reason; when a group gives no result (it timed
# out or crashed), in any configuration; and when a configuration ran a different number of
# tests than Numba's own manager did.
set -u
out=${OUT:-/tmp}
shards=${SHARDS:-3}
limit=${NUMBA_SUITE_TIMEOUT:-520}
pkg=$(python3 -c 'import os, numba.cuda.tests.cudapy as m; print(os.path.dirname(m.__file__))') || exit 1
mods=(numba.cuda.tests.cudadrv)
for f in $(cd "$pkg" && ls test_*.py | sort); do mods+=("numba.cuda.tests.cudapy.${f%.py}"); done
work=$(mktemp -d)
configs=(numba emm-default emm-pool)
setup() {
    case $1 in
    numba) echo NUMBA_CUDA_MEMORY_MANAGER=default ;;
    emm-default) echo NUMBA_CUDA_MEMORY_MANAGER=emm.numba EMM_MEMORY_MANAGER=default ;;
    emm-pool) echo NUMBA_CUDA_MEMORY_MANAGER=emm.numba EMM_MEMORY_MANAGER=pool ;;
    esac
}
# The ERROR and FAIL lines of unittest logs.
fail_lines() { grep -ahE '^(ERROR|FAIL): ' "$@"; }
# A count from a unittest result line ("FAILED (failures=2, skipped=5)"), 0 when absent.
v() { grep -oE "[(,] ?$1=[0-9]+" <<<"$tail" | grep -oE '[0-9]+$' || echo 0; }
start=$(date +%s)
declare -A pid rc
for c in "${configs[@]}"; do
    for ((s = 0; s < shards; s++)); do
        group=()
        for ((i = s; i < ${#mods[@]}; i += shards)); do group+=("${mods[$i]}"); done
        env $(setup "$c") PYTHONUNBUFFERED=1 timeout "$limit" \
            python3 -m numba.runtests -v "${group[@]}" >"$work/$c.$s.log" 2>&1 &
        pid[$c.$s]=$!
    done
done
for k in "${!pid[@]}"; do
    wait "${pid[$k]}"
    rc[$k]=$?
done
elapsed=$(($(date +%s) - start))
summary=$out/numba-full-summary.txt
{
    echo "numba-cuda suite: ${#mods[@]} modules in $shards groups per configuration, $elapsed s"
    printf '%-12s %6s %6s %6s %6s %6s %6s %s\n' config run ok skipped failed errors xfail exits
    declare -gA ran
    for c in "${configs[@]}"; do
        : >"$out/numba-full-$c.log"
        run=0 skipped=0 failed=0 errors=0 xfail=0 exits=""
        for ((s = 0; s < shards; s++)); do
            log=$work/$c.$s.log
            cat "$log" >>"$out/numba-full-$c.log"
            n=$(grep -aoE '^Ran [0-9]+ tests' "$log" | grep -oE '[0-9]+' | tail -1)
            tail=$(grep -aE '^(OK|FAILED)' "$log" | tail -1)
            if [ -z "$n" ]; then
                case ${rc[$c.$s]} in
                124) exits="$exits group$s:timed-out(${limit}s)" ;;
                *) exits="$exits group$s:no-result(exit ${rc[$c.$s]})" ;;
                esac
                echo "$c group $s" >>"$work/no-result"
            fi
            run=$((run + ${n:-0}))
            skipped=$((skipped + $(v skipped)))
            failed=$((failed + $(v failures)))
            errors=$((errors + $(v errors)))
            xfail=$((xfail + $(v 'expected failures')))
        done
        ok=$((run - skipped - failed - errors - xfail))
        ran[$c]=$run
        printf '%-12s %6d %6d %6d %6d %6d %6d %s\n' "$c" "$run" "$ok" "$skipped" "$failed" "$errors" "$xfail" "${exits:-all groups finished}"
    done
    for c in "${configs[@]}"; do
        echo "-- $c: failing tests"
        fail_lines "$out/numba-full-$c.log" | sort
    done
} >"$summary"

# Modules with a failing test (import failures aside: they do not depend on the manager) run
# again alone.
failing() { fail_lines "$@" | grep -v '_FailedTest' | sed -E 's/^[A-Z]+: [^ ]+ \(([^ ]+)\)$/\1/' | sort -u; }
rerun=$(failing "$out"/numba-full-*.log | sed -E 's/\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+$//' | sort -u)
declare -A final
for c in "${configs[@]}"; do
    final[$c]=$(fail_lines "$out/numba-full-$c.log" | grep '_FailedTest' | sed -E 's/^[A-Z]+: ([^ ]+) .*/import:\1/' | sort -u)
done
if [ -n "$rerun" ]; then
    echo "-- alone again: $(echo $rerun)" >>"$summary"
    for c in "${configs[@]}"; do
        log=$out/numba-full-$c.log
        echo "=== alone again: $rerun" >>"$log"
        env $(setup "$c") PYTHONUNBUFFERED=1 timeout 300 python3 -m numba.runtests -v $rerun \
            >"$work/$c.rerun.log" 2>&1
        cat "$work/$c.rerun.log" >>"$log"
        echo "$c: $(grep -aE '^Ran [0-9]+ tests' "$work/$c.rerun.log") $(grep -aE '^(OK|FAILED)' "$work/$c.rerun.log" | tail -1)" >>"$summary"
        final[$c]=$(printf '%s\n%s\n' "${final[$c]}" "$(failing "$work/$c.rerun.log")" | grep . | sort -u)
    done
fi
# Tests that fail under emm.numba because of what the test assumes, not because of emm: each
# with the reason, reported but not counted against emm.
explained() {
    case "$1:$2" in
    emm-pool:numba.cuda.tests.cudapy.test_ipc.TestIpcMemory.test_ipc_handle)
        echo "the test sends only the handle's bytes (\`ipch.handle.reserved\`) and opens them at offset 0; under a pool the array may start inside a larger driver allocation, and the IpcHandle's offset, which it drops, says where (python/tests: test_numba_ipc_handle_opens_in_numba_without_emm[pool] opens such an array through the IpcHandle)" ;;
    *) return 1 ;;
    esac
}
status=0
if [ -s "$work/no-result" ]; then
    status=1
    echo "-- groups that gave no result (timed out or crashed; their tests did not run): $(tr '\n' ';' <"$work/no-result")" >>"$summary"
fi
for c in emm-default emm-pool; do
    if [ "${ran[$c]}" != "${ran[numba]}" ]; then
        status=1
        echo "-- $c ran ${ran[$c]} tests where Numba's manager ran ${ran[numba]}: some did not run" >>"$summary"
    fi
done
for c in emm-default emm-pool; do
    extra=$(comm -13 <(echo "${final[numba]}") <(echo "${final[$c]}") | grep .)
    for t in $extra; do
        if why=$(explained "$c" "$t"); then
            echo "-- $c: $t fails, explained: $why" >>"$summary"
        else
            status=1
            echo "-- $c: failing under emm.numba and not under Numba's manager: $t" >>"$summary"
        fi
    done
done
echo "-- failing in the end (Numba's manager): $(echo ${final[numba]})" >>"$summary"
[ $status = 0 ] && echo "numba-cuda suite: PASS (no test fails under emm.numba that passes under Numba's manager)" >>"$summary" \
    || echo "numba-cuda suite: FAIL" >>"$summary"
cat "$summary"
exit $status
