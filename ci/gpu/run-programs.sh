#!/usr/bin/env bash
# Real programs on the GPU (`integration/traces/record/programs.py`): five PyTorch workloads,
# each under PyTorch's caching allocator (default, and expandable segments) and under emm's
# `pool` and `vmm-pool`, one process each: peak held over peak live, driver allocations and
# frees, bytes given back, time per step, and the targets met or missed. Its table is
# BENCHMARKS.md's memory section. Run from the repository root on the GPU machine with the
# emm wheel installed (PYTHONPATH); files go to $OUT:
#
#   programs.txt, programs.jsonl    the table and every run's result line
#   programs-gpu.txt                the card
#   programs-logs.part-*            with PROGRAMS_LOGS=transformer,cnn,...: those programs run
#                                   again under `pool` and `vmm-pool` with the `log` adaptor,
#                                   their logs (with the GPU's progress) in a tar split in
#                                   15 MB parts, for `replay` on the simulator; their figures
#                                   in programs-logged.txt
#
# PROGRAMS_ROUNDS (3 unless set) runs every program under every allocator that many times, the
# order rotating from round to round: step times move by more than the 3 % target from one
# process to the next, so the table compares them by the median of the rounds' ratios to
# PyTorch's in the same round, and checks held memory in every round.
#
# Fails when a run fails or its results differ from PyTorch's; a missed target is stated in
# the table, not a failure. PROGRAMS_TIMEOUT and LOGS_TIMEOUT bound the two halves (seconds).
set -u
out=${OUT:?set OUT to a folder for the results}
record=integration/traces/record
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/programs-gpu.txt" 2>&1
status=0
timeout "${PROGRAMS_TIMEOUT:-2400}" python3 "$record/programs.py" --out "$out/programs.jsonl" \
    --rounds "${PROGRAMS_ROUNDS:-3}" >"$out/programs.txt" 2>&1 || status=1
grep -v '^#' "$out/programs.txt"
if [ -n "${PROGRAMS_LOGS:-}" ]; then
    logs=$(mktemp -d)
    timeout "${LOGS_TIMEOUT:-300}" python3 "$record/programs.py" --programs "$PROGRAMS_LOGS" \
        --allocators pool,vmm-pool --log-dir "$logs/logs" --out "$out/programs-logged.jsonl" \
        >"$out/programs-logged.txt" 2>&1 || status=1
    grep -v '^#' "$out/programs-logged.txt"
    tar -cf - -C "$logs" logs | split -b 15000000 - "$out/programs-logs.part-"
fi
exit $status
