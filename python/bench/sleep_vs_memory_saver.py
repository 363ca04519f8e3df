"""emm's sleep and wake beside torch_memory_saver's pause and resume, on one GPU, under PyTorch.

Each case runs in a process of its own, once under emm (``emm.torch.install()``, ``vmm-pool``
with the ``history`` adaptor, ``emm.torch.sleep`` / ``wake``) and once under
torch_memory_saver (its ``torch`` hook mode: a PyTorch pluggable allocator, ``region``,
``pause`` / ``resume``):

- ``idle``: ``--idle-gib`` tensors of 1 GiB, none of them kept: the time to give the memory
  back and to map it again;
- ``offload``: ``--weights-gib`` tensors of 1 GiB whose contents go to host memory and come
  back (emm: ``offload=["weights"]``; torch_memory_saver: ``enable_cpu_backup=True``) beside
  ``--scratch-gib`` of tensors whose contents go (emm: ``discard``; torch_memory_saver: a
  region without backup): the sleep's and the wake's times, the weights' copy rate, and the
  weights checked bit for bit after the wake.

torch_memory_saver is measured where it imports; otherwise its rows say why not. Prints one
JSON line (``--out`` writes it too). Run on the GPU:

    EMM_PYTHON_DRIVER=cuda python3 sleep_vs_memory_saver.py --out sleep-vs-tms.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30


def tensors(gib, value):
    """``gib`` CUDA tensors of 1 GiB, the k-th filled with ``value + k``."""
    import torch

    return [torch.full((GIB,), (value + k) % 251, dtype=torch.uint8, device="cuda") for k in range(gib)]


def intact(ts, value):
    """Whether every tensor still holds what :func:`tensors` wrote."""
    return all(bool((t[:: 1 << 20] == (value + k) % 251).all()) for k, t in enumerate(ts))


def timed(sleep, wake):
    """Runs ``sleep`` then ``wake`` once the device is idle, each waited for on the device:
    their results and their times in seconds."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    slept = sleep()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    woke = wake()
    torch.cuda.synchronize()
    return slept, woke, t1 - t0, time.perf_counter() - t1


def run_emm(case, weights_gib, scratch_gib):
    """One case under emm: the tensors (still held) and the figures."""
    import emm
    import emm.torch

    emm.torch.install()
    with emm.tag("weights"):
        weights = tensors(weights_gib, 3)
    scratch = tensors(scratch_gib, 100)
    offload = [] if case == "idle" else ["weights"]
    slept, woke, asleep, awake = timed(
        lambda: emm.torch.sleep(offload=offload, default="discard"), emm.torch.wake
    )
    ok = intact(weights, 3)
    return (weights, scratch), {
        "sleep_seconds": asleep,
        "wake_seconds": awake,
        "held_before_bytes": slept["held_before_bytes"],
        "held_asleep_bytes": slept["held_asleep_bytes"],
        "offloaded_bytes": slept["offloaded_bytes"],
        "offload_copy_seconds": slept["offload_seconds"],
        "mapped_again_bytes": woke["mapped_bytes"],
        "restore_copy_seconds": woke["restore_seconds"],
        "weights_intact": ok,
    }


def run_tms(case, weights_gib, scratch_gib):
    """One case under torch_memory_saver: the tensors (still held) and the figures."""
    import torch

    try:
        from torch_memory_saver import torch_memory_saver as tms
    except Exception as e:  # noqa: BLE001 - any import failure means it cannot be measured
        return (), {"not_measured": f"torch_memory_saver does not import here: {e}"}
    tms.hook_mode = "torch"
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = tensors(weights_gib, 3)
    with tms.region(tag="scratch"):
        scratch = tensors(scratch_gib, 100)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]

    def pause():
        tms.pause()
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    free_asleep, _, asleep, awake = timed(pause, tms.resume)
    ok = intact(weights, 3)
    return (weights, scratch), {
        "sleep_seconds": asleep,
        "wake_seconds": awake,
        "given_back_bytes": free_asleep - free_before,
        "weights_intact": ok,
    }


def child(args):
    runner = run_emm if args.allocator == "emm" else run_tms
    weights = 0 if args.case == "idle" else args.weights_gib
    scratch = args.idle_gib if args.case == "idle" else args.scratch_gib
    # The figures are printed before the tensors go, so that a failure freeing them is told
    # apart from one measuring.
    held, row = runner(args.case, weights, scratch)
    print(json.dumps(row), flush=True)
    del held


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle-gib", type=int, default=40)
    ap.add_argument("--weights-gib", type=int, default=8)
    ap.add_argument("--scratch-gib", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--allocator", choices=["emm", "tms"])
    ap.add_argument("--case", choices=["idle", "offload"])
    args = ap.parse_args()
    if args.allocator:
        return child(args)
    env = dict(os.environ, EMM_MEMORY_MANAGER="vmm-pool", EMM_MEMORY_ADAPTORS="history")
    env.pop("EMM_VMM_PIECE", None)
    results = {}
    for case in ["idle", "offload"]:
        for allocator in ["emm", "tms"]:
            p = subprocess.run(
                [sys.executable, __file__, "--allocator", allocator, "--case", case,
                 "--idle-gib", str(args.idle_gib), "--weights-gib", str(args.weights_gib),
                 "--scratch-gib", str(args.scratch_gib)],
                env=env, capture_output=True, text=True, timeout=300,
            )
            lines = p.stdout.strip().splitlines()
            if not lines or not lines[-1].startswith("{"):
                results[f"{case}/{allocator}"] = {"failed": p.stderr[-2000:]}
                continue
            row = json.loads(lines[-1])
            if p.returncode != 0:
                # Measured, then the process failed on its way out: said beside the figures.
                row["exit_status"] = p.returncode
                row["exit_error"] = p.stderr[-500:]
            if case == "offload" and "sleep_seconds" in row:
                row["weights_rate_bytes_per_s"] = args.weights_gib * GIB / row["sleep_seconds"]
            results[f"{case}/{allocator}"] = row
    line = json.dumps(results)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    failed = [k for k, v in results.items() if "failed" in v or v.get("weights_intact") is False]
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
