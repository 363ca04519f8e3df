"""Two processes on one GPU hand its memory back and forth through emm's sleep and wake.

A PyTorch trainer under ``emm.torch`` (``vmm-pool``, the ``history`` adaptor) trains an MLP a
few steps, sleeps (weights and optimizer state offloaded, everything else discarded), a second
process allocates most of the device with PyTorch's own allocator and frees it, the trainer
wakes and trains on. The same training runs uninterrupted in a third process; the losses must
be bit-identical. The trainer then sleeps and wakes twice more keeping its host buffer (the
second sleep reuses it). Then a sleep with nothing to offload, of ``--idle-gib`` held, is timed (with
the default pieces of physical memory and with ``EMM_VMM_PIECE=32MiB``), and
the pinned copy rate of this machine is measured with PyTorch for the offload's anchor.

Prints one JSON line of figures (``--out`` writes it to a file too). Run on the GPU:

    EMM_PYTHON_DRIVER=cuda python3 sleep_handoff.py --out handoff.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 1 << 20
GIB = 1 << 30


def train(steps_before, steps_after, width, layers, sleep, result):
    """Trains the MLP ``steps_before`` steps, sleeps and hands the device to another process
    (when ``sleep``), then ``steps_after`` steps; writes the losses and figures to ``result``."""
    import torch

    import emm
    import emm.torch

    emm.torch.install()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda", 0)
    with emm.tag("weights"):
        model = torch.nn.Sequential(
            *[torch.nn.Linear(width, width, device=dev) for _ in range(layers)]
        )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=dev).manual_seed(1)
    losses = []
    figures = {}

    def step():
        x = torch.randn(256, width, device=dev, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        with emm.tag("optimizer"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for _ in range(steps_before):
        step()
    if sleep:
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        report = emm.torch.sleep(offload=["weights", "optimizer"], default="discard")
        free_asleep = torch.cuda.mem_get_info()[0]
        other = subprocess.run(
            [sys.executable, __file__, "--role", "other"], capture_output=True, text=True
        )
        if other.returncode != 0:
            raise SystemExit("the other process failed: " + other.stderr[-2000:])
        woke = emm.torch.wake()
        figures = {
            "sleep": report,
            "wake": woke,
            "freed_by_sleep_bytes": free_asleep - free_awake,
            "other": json.loads(other.stdout.strip().splitlines()[-1]),
        }
    for _ in range(steps_after):
        step()
    if sleep:
        # Sleeps as a process that hands the device back and forth often: the host buffer kept
        # after the first wake serves the second sleep, with no new page-locked allocation.
        figures["repeat"] = []
        for _ in range(2):
            s = emm.torch.sleep(
                offload=["weights", "optimizer"], default="discard", keep_host_buffer=True
            )
            w = emm.torch.wake()
            figures["repeat"].append({"sleep": s, "wake": w})
        emm.context(0).trim()
    with open(result, "w") as f:
        json.dump({"losses": losses, **figures}, f)


def other():
    """The second process: takes all but 1 GiB of what is free with PyTorch's own allocator,
    writes it, frees it."""
    import torch

    free = torch.cuda.mem_get_info()[0]
    take = max(free - GIB, 0)
    t0 = time.perf_counter()
    x = torch.empty(take, dtype=torch.uint8, device="cuda")
    x.fill_(7)
    torch.cuda.synchronize()
    ok = bool((x[:: 1 << 24] == 7).all())
    del x
    torch.cuda.empty_cache()
    print(json.dumps({"took_bytes": take, "ok": ok, "seconds": time.perf_counter() - t0}))


def idle_sleep(gib):
    """Times a sleep and a wake of ``gib`` GiB held under vmm-pool with nothing to offload."""
    import emm

    ctx = emm.context(0)
    blocks = [ctx.memalloc(GIB) for _ in range(gib)]
    t0 = time.perf_counter()
    slept = ctx.sleep(default="discard")
    t1 = time.perf_counter()
    woke = ctx.wake()
    t2 = time.perf_counter()
    del blocks
    return {
        "held_bytes": slept["held_before_bytes"],
        "held_asleep_bytes": slept["held_asleep_bytes"],
        "sleep_seconds": t1 - t0,
        "wake_seconds": t2 - t1,
        "mapped_again_bytes": woke["mapped_bytes"],
    }


def pinned_rate(gib):
    """PyTorch's pinned copy rate on this machine, device to host and back, in bytes/s."""
    import torch

    n = gib * GIB
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rates = {}
    for name, (dst, src) in {"d2h": (h, d), "h2d": (d, h)}.items():
        dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        rates[name] = n / (time.perf_counter() - t0)
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main", choices=["main", "train", "other", "idle"])
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sleep", type=int, default=1)
    ap.add_argument("--result")
    ap.add_argument("--idle-gib", type=int, default=40)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.role == "train":
        return train(a.steps, a.steps, a.width, a.layers, bool(a.sleep), a.result)
    if a.role == "other":
        return other()
    if a.role == "idle":
        print(json.dumps(idle_sleep(a.idle_gib)))
        return None
    env = {
        **os.environ,
        "EMM_MEMORY_MANAGER": "vmm-pool",
        "EMM_MEMORY_ADAPTORS": "history",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    runs = {}
    for name, sleep in [("handed_off", 1), ("uninterrupted", 0)]:
        path = f"/tmp/sleep_handoff_{name}.json"
        p = subprocess.run(
            [sys.executable, __file__, "--role", "train", "--sleep", str(sleep), "--result", path]
            + ["--width", str(a.width), "--layers", str(a.layers), "--steps", str(a.steps)],
            env=env,
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            raise SystemExit(f"{name} failed: {p.stderr[-3000:]}")
        with open(path) as f:
            runs[name] = json.load(f)
    idle = {}
    for piece in [None, "32MiB"]:
        idle_env = {k: v for k, v in env.items() if k not in ("EMM_MEMORY_ADAPTORS", "EMM_VMM_PIECE")}
        if piece:
            idle_env["EMM_VMM_PIECE"] = piece
        p = subprocess.run(
            [sys.executable, __file__, "--role", "idle", "--idle-gib", str(a.idle_gib)],
            env=idle_env,
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            raise SystemExit(f"idle sleep (pieces {piece or 'default'}) failed: " + p.stderr[-3000:])
        idle[piece or "default"] = json.loads(p.stdout.strip().splitlines()[-1])
    handed = runs["handed_off"]
    offloaded = handed["sleep"]["offloaded_bytes"]
    out = {
        "losses_identical": handed["losses"] == runs["uninterrupted"]["losses"],
        "losses": handed["losses"],
        "reference_losses": runs["uninterrupted"]["losses"],
        "sleep": handed["sleep"],
        "wake": handed["wake"],
        "freed_by_sleep_bytes": handed["freed_by_sleep_bytes"],
        "other": handed["other"],
        "repeat": handed.get("repeat", []),
        "offload_rate_bytes_per_s": offloaded / handed["sleep"]["offload_seconds"],
        "restore_rate_bytes_per_s": handed["wake"]["restored_bytes"]
        / handed["wake"]["restore_seconds"],
        "pinned_rate_bytes_per_s": pinned_rate(4),
        "idle": idle["default"],
        "idle_32mib_pieces": idle["32MiB"],
    }
    line = json.dumps(out)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    if not out["losses_identical"] or not handed["other"]["ok"]:
        raise SystemExit("the hand-off changed the training or the other process failed")
    return None


if __name__ == "__main__":
    main()
