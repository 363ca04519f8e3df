"""Numba, CuPy and PyTorch over emm, on the GPU. Each scenario runs in a fresh interpreter:
a framework's allocator is chosen before its first allocation, and each process has one emm
runtime. On the simulator these skip (a reason is given); under EMM_REQUIRE_GPU=1 they must run.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_gpu, needs_module


def run(code, **env):
    full = dict(os.environ, EMM_PYTHON_DRIVER="cuda", EMM_MEMORY_ADAPTORS="stats")
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )
    assert out.returncode == 0, "stdout:\n%s\nstderr:\n%s" % (out.stdout, out.stderr)
    return out.stdout


NUMBA_KERNEL = """
    import numpy as np
    from numba import cuda

    @cuda.jit
    def fill(a, v):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = v + i
"""


def test_numba_allocates_from_emm():
    needs_gpu("Numba kernels")
    needs_module("numba.cuda")
    out = run(
        NUMBA_KERNEL
        + """
    import emm
    ctx = emm.context(0)
    a = cuda.device_array(1000, dtype=np.float32)
    fill[4, 256](a, 1.0)
    host = a.copy_to_host()
    assert host[999] == 1000.0, host[999]
    u = ctx.usage()
    assert u["device"]["current_count"] >= 1, u
    # Managed, mapped and pinned arrays, and a pin of a NumPy array.
    m = cuda.managed_array(100, dtype=np.float32)
    fill[1, 128](m, 3.0)
    cuda.synchronize()
    assert m[99] == 102.0
    assert ctx.usage()["managed"]["current_count"] >= 1
    mapped = cuda.mapped_array(100, dtype=np.float32)
    fill[1, 128](mapped, 5.0)
    cuda.synchronize()
    assert mapped[99] == 104.0
    pinned = cuda.pinned_array(100, dtype=np.float32)
    a[:100].copy_to_host(pinned)
    assert pinned[99] == 100.0
    buf = np.zeros(100, dtype=np.float32)
    with cuda.pinned(buf):
        a[:100].copy_to_host(buf)
    assert buf[99] == 100.0
    # defer_cleanup is emm's guard.
    before = ctx.pending
    with cuda.defer_cleanup():
        b = cuda.device_array(10)
        del b
        assert ctx.pending == before + 1
    ctx.flush()
    info = cuda.current_context().get_memory_info()
    assert 0 < info.free <= info.total
    print("numba ok")
    """,
        NUMBA_CUDA_MEMORY_MANAGER="emm.numba",
    )
    assert "numba ok" in out


@pytest.mark.parametrize("manager", ["default", "pool"])
def test_numba_ipc_handle_opens_in_numba_without_emm(manager):
    """A Numba IpcHandle from emm memory, opened by a Numba process using its own manager.
    Under `pool` the array starts inside a larger driver allocation (a smaller one is carved
    first): the handle names that allocation and carries the offset, which the other process
    applies. (numba-cuda's own `test_ipc_handle` sends the handle's bytes without the offset
    and opens them at 0, so under a pool it reads the driver allocation's start.)"""
    needs_gpu("IPC")
    needs_module("numba.cuda")
    out = run(
        NUMBA_KERNEL
        + """
    import os, pickle, subprocess, sys
    pad = cuda.device_array(1000, dtype=np.float32)
    a = cuda.device_array(1000, dtype=np.float32)
    fill[4, 256](a, 0.0)
    cuda.synchronize()
    if os.environ["EMM_MEMORY_MANAGER"] == "pool":
        offset = cuda.current_context().get_ipc_handle(a.gpu_data).offset
        assert offset > 0, ("the pool carved the array from a larger block", offset)
    for view in (a, a[100:], a[100:400], a[:400]):
        h = view.get_ipc_handle()
        child = (
            "import pickle, sys; from numba import cuda; import numpy as np; "
            "h = pickle.loads(bytes.fromhex(sys.argv[1])); "
            "arr = h.open(); sys.stdout.write(repr(float(arr.copy_to_host()[-1]))); h.close()"
        )
        env = dict(os.environ)
        env.pop("NUMBA_CUDA_MEMORY_MANAGER")
        r = subprocess.run([sys.executable, "-c", child, pickle.dumps(h).hex()],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert float(r.stdout) == float(view.copy_to_host()[-1]), (r.stdout, view.shape)
    print("ipc ok")
    """,
        NUMBA_CUDA_MEMORY_MANAGER="emm.numba",
        EMM_MEMORY_MANAGER=manager,
    )
    assert "ipc ok" in out


@pytest.mark.parametrize("c_functions", [True, False])
def test_cupy_allocates_from_emm(c_functions):
    needs_gpu("CuPy")
    needs_module("cupy")
    out = run(
        f"""
    import cupy, emm, emm.cupy
    from emm import _emm
    c_functions = {c_functions}
    emm.cupy.install(c_functions=c_functions)
    x = cupy.arange(1000, dtype=cupy.float32)
    assert float((x * 2).sum()) == 999000.0
    assert emm.context(0).usage()["device"]["current_count"] >= 1
    empty = cupy.empty(0)
    # On a stream of CuPy's: the memory is allocated (and freed) there.
    with cupy.cuda.Stream(non_blocking=True) as s:
        y = cupy.arange(1 << 20, dtype=cupy.float32)
        if c_functions:
            size, stream = _emm.cupy_allocation(y.data.mem.ptr)
            assert size == 4 << 20 and stream == s.ptr, (size, stream, s.ptr)
            assert emm.cupy.used_bytes() >= 4 << 20
        else:
            # CuPy keeps an UnownedMemory's owner (emm's buffer) in `_owner`.
            owner = y.data.mem._owner
            assert owner.stream == s.ptr, (owner.stream, s.ptr)
        z = y * 3
        total = float(z[-1])
        del y, z
    s.synchronize()
    assert total == 3.0 * ((1 << 20) - 1)
    # More than any GPU has: emm's error comes out of CuPy's call, and nothing is held.
    before = emm.context(0).usage()["device"]["current_count"]
    try:
        cupy.empty(1 << 50, dtype=cupy.uint8)
        raise SystemExit("1 PiB was allocated")
    except emm.OutOfMemoryError as e:
        assert "out of" in str(e).lower(), e
    assert emm.context(0).usage()["device"]["current_count"] == before
    if c_functions:
        del x, empty
        assert emm.cupy.used_bytes() == 0, emm.cupy.used_bytes()
        emm.cupy.free_all_blocks()
    print("cupy ok")
    """
    )
    assert "cupy ok" in out


@pytest.mark.parametrize("manager", ["default", "pool", "async-pool"])
def test_frameworks_on_their_streams(manager):
    """CuPy and PyTorch allocating on their own non-default streams under each manager:
    blocks freed on one stream and allocated on another, with work queued on both, never
    lose bytes (each array is checked after all streams are done)."""
    needs_gpu("CuPy and PyTorch")
    needs_module("cupy")
    needs_module("torch")
    out = run(
        """
    import cupy, torch, emm, emm.cupy, emm.torch
    emm.cupy.install()
    emm.torch.install()
    streams = [torch.cuda.Stream() for _ in range(3)]
    kept = []
    for round in range(20):
        for k, s in enumerate(streams):
            with torch.cuda.stream(s):
                t = torch.full((1 << 18,), float(round * 3 + k), device="cuda")
                t = t * 2
                if round % 2:
                    kept.append((t, 2.0 * (round * 3 + k)))
                else:
                    del t
            cs = cupy.cuda.ExternalStream(s.cuda_stream)
            with cs:
                c = cupy.full(1 << 18, round * 3 + k, dtype=cupy.float32) + 1
                if round % 2:
                    kept.append((c, round * 3 + k + 1.0))
                else:
                    del c
    torch.cuda.synchronize()
    for x, want in kept:
        lo, hi = float(x.min()), float(x.max())
        assert lo == hi == want, (lo, hi, want)
    assert emm.torch.last_error() is None
    print("streams ok", emm.context(0).stream_ordering())
    """,
        EMM_MEMORY_MANAGER=manager,
    )
    assert "streams ok" in out


def test_torch_allocates_from_emm():
    needs_gpu("PyTorch")
    needs_module("torch")
    out = run(
        """
    import torch, emm, emm.torch
    emm.torch.install()
    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert (t * 2).sum().item() == 999000.0
    assert emm.torch.live() >= 1
    assert emm.context(0).usage()["device"]["current_count"] >= 1
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        u = torch.ones(1 << 20, device="cuda") * 5
    s.synchronize()
    assert u.sum().item() == 5.0 * (1 << 20)
    del t, u
    torch.cuda.synchronize()
    assert emm.torch.last_error() is None
    print("torch ok")
    """
    )
    assert "torch ok" in out


@pytest.mark.parametrize("manager", ["default", "pool", "vmm-pool", "async-pool"])
def test_torch_memory_stats_under_install(manager):
    """The statistics PyTorch refuses under a pluggable allocator, from emm.torch: allocated
    bytes as the tensors', peaks, reserve as the manager's, and the OOM count."""
    needs_gpu("PyTorch")
    needs_module("torch")
    out = run(
        """
    import torch, emm, emm.torch
    emm.torch.install()
    try:
        torch.cuda.memory_stats()
        print("pytorch answered")
    except RuntimeError as e:
        assert "getDeviceStats" in str(e), e
    base = emm.torch.memory_allocated()
    a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    st = emm.torch.memory_stats()
    assert st["allocated_bytes.all.current"] - base == 4 << 20, st
    assert st["reserved_bytes.all.current"] >= st["allocated_bytes.all.current"], st
    del b
    torch.cuda.synchronize()
    assert emm.torch.memory_allocated() - base == 1 << 20
    assert emm.torch.max_memory_allocated() - base >= 4 << 20
    emm.torch.reset_peak_memory_stats()
    assert emm.torch.max_memory_allocated() == emm.torch.memory_allocated()
    # A failed allocation raises (PyTorch's pluggable allocator, left alone, gives a tensor
    # at address 0), with emm's message: twice the device's memory, on any card.
    try:
        too_much = 2 * torch.cuda.get_device_properties(0).total_memory
        t = torch.empty(too_much, dtype=torch.uint8, device="cuda")
        raise SystemExit("no error: a tensor at 0x%x" % t.data_ptr())
    except RuntimeError as e:
        assert "out of memory on device 0" in str(e), e
    assert emm.torch.memory_stats()["num_ooms"] == 1
    assert "allocated" in emm.torch.memory_summary()
    del a
    torch.cuda.synchronize()
    emm.torch.empty_cache()
    print("stats ok")
    """,
        EMM_MEMORY_MANAGER=manager,
    )
    assert "stats ok" in out


@pytest.mark.parametrize("manager", ["default", "pool", "vmm-pool", "async-pool"])
def test_torch_record_stream_keeps_memory_from_reuse(manager):
    """Under ``install()``, a tensor read on a side stream, ``record_stream``-ed and freed while
    that stream's work is still queued keeps its memory from the next allocation on the default
    stream, whose write would land before the side stream's read. The record is made through
    PyTorch's C++ (``TensorBase.record_stream``, no Python wrapper in between), as PyTorch's
    own C++ callers make it: it reaches emm through the allocator's record-stream hook. The
    same program without the record is the control: its figures are printed (whether the
    block was reused, what the side stream read), showing the hazard the record prevents on
    this GPU."""
    needs_gpu("PyTorch")
    needs_module("torch")
    out = run(
        """
    import torch, emm, emm.torch
    emm.torch.install()
    assert emm.torch.record_stream_hooked(), "this PyTorch has no record-stream hook"
    cxx_record_stream = torch._C.TensorBase.record_stream
    n = 1 << 22

    def trial(record):
        side = torch.cuda.Stream()
        x = torch.full((n,), 3.0, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # the read below waits behind this
            out = x * 1.0
        if record:
            cxx_record_stream(x, side)
        addr = x.data_ptr()
        del x
        y = torch.full((n,), 7.0, device="cuda")  # the default stream, at once
        reused = y.data_ptr() == addr
        side.synchronize()
        torch.cuda.synchronize()
        return out.min().item(), out.max().item(), reused

    read = trial(True)
    assert read[:2] == (3.0, 3.0), read
    assert emm.torch.last_error() is None, emm.torch.last_error()
    print("record ok", read, "control", trial(False))
    """,
        EMM_MEMORY_MANAGER=manager,
    )
    assert "record ok" in out


@pytest.mark.parametrize("manager", ["pool", "vmm-pool"])
def test_framework_words_give_memory_back(manager):
    """``torch.cuda.empty_cache()`` under ``emm.torch.install()`` and
    ``cupy.get_default_memory_pool().free_all_blocks()`` under ``emm.cupy.install()`` give
    back what emm's pool holds unused, as they do under the frameworks' own allocators."""
    needs_gpu("PyTorch and CuPy")
    needs_module("torch")
    needs_module("cupy")
    out = run(
        """
    import cupy, torch
    import emm, emm.cupy, emm.torch
    emm.torch.install()
    emm.cupy.install()
    ctx = emm.context(0)
    def held():
        return ctx.pool_stats()["device"]["held_bytes"]
    xs = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    assert held() >= 256 << 20, held()
    del xs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert held() < 64 << 20, ("torch.cuda.empty_cache() kept", held())
    assert torch.cuda.empty_cache.__wrapped__ is not None
    ys = [cupy.empty(64 << 20, dtype=cupy.uint8) for _ in range(4)]
    cupy.cuda.Device().synchronize()
    assert held() >= 256 << 20, held()
    pool = cupy.get_default_memory_pool()
    assert pool.used_bytes() >= 256 << 20, pool.used_bytes()
    del ys
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    assert held() < 64 << 20, ("free_all_blocks() kept", held())
    assert pool.total_bytes() == held()
    print("emptied ok")
    """,
        EMM_MEMORY_MANAGER=manager,
    )
    assert "emptied ok" in out


@pytest.mark.parametrize("manager", ["pool", "vmm-pool", "async-pool"])
def test_torch_snapshot_loads_in_memory_viz(manager):
    """A snapshot taken in the middle of a training step (history on): PyTorch's own
    _memory_viz functions read emm's PyTorch-format export, every block of every segment is
    there, the tensors' blocks are tagged torch, and the pickle and HTML files are written."""
    needs_gpu("PyTorch")
    needs_module("torch")
    out = run(
        """
    import os, pickle, tempfile, torch, emm, emm.torch
    from torch.cuda import _memory_viz as viz
    emm.torch.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        x = torch.randn(64 * (step + 1), 512, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        if step == 2:
            snap = emm.torch.memory_snapshot()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert snap["segments"], snap
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"], seg
    tags = {t for t in snap["emm"]["tags"]}
    assert tags == {"torch"}, tags
    active = sum(b["size"] for s in snap["segments"] for b in s["blocks"]
                 if b["state"] == "active_allocated")
    assert active >= sum(p.numel() * 4 for p in model.parameters()), active
    assert any(e["action"] == "alloc" for e in snap["device_traces"][0])
    text = viz.segsum(snap)
    assert "Summary of segments" in text or "SEGMENT" in text, text[:200]
    for name in ("trace_plot", "segment_plot"):
        if hasattr(viz, name):
            html = getattr(viz, name)(snap)
            assert "<" in html and len(html) > 1000, (name, html[:200])
    d = tempfile.mkdtemp()
    emm.torch.dump_snapshot(os.path.join(d, "snap.pickle"))
    with open(os.path.join(d, "snap.pickle"), "rb") as f:
        assert pickle.load(f)["segments"]
    emm.context(0).snapshot().save_html(os.path.join(d, "snap.html"))
    print("viz ok", len(snap["segments"]), "segments", active, "bytes active")
    """,
        EMM_MEMORY_MANAGER=manager,
        EMM_MEMORY_ADAPTORS="history",
    )
    assert "viz ok" in out


def test_three_frameworks_share_one_runtime():
    """Numba, CuPy and PyTorch in one process: one manager, one usage(); a Numba kernel reads
    a CuPy array and a torch tensor made by emm."""
    needs_gpu("all three frameworks")
    for m in ("numba.cuda", "cupy", "torch"):
        needs_module(m)
    out = run(
        """
    import numpy as np
    import cupy, torch
    from numba import cuda
    import emm, emm.cupy, emm.torch
    emm.cupy.install()
    emm.torch.install()

    @cuda.jit
    def add(a, b, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a[i] + b[i]

    x = cupy.arange(256, dtype=cupy.float32)
    t = torch.arange(256, device="cuda", dtype=torch.float32)
    out = cuda.device_array(256, dtype=np.float32)
    add[1, 256](cuda.as_cuda_array(x), cuda.as_cuda_array(t), out)
    host = out.copy_to_host()
    assert host[255] == 510.0, host[255]
    u = emm.context(0).usage()["device"]
    assert u["current_count"] >= 3, u
    print("shared ok", u["current_count"])
    """,
        NUMBA_CUDA_MEMORY_MANAGER="emm.numba",
    )
    assert "shared ok" in out


def test_numba_deallocation_rules():
    """What Numba's own deallocation tests check (its suite skips them under any external
    manager), through Numba's public API over emm's default manager: the 11th pending free
    flushes the queue (Numba's CUDA_DEALLOCS_COUNT, 10); one free larger than the byte budget
    (CUDA_DEALLOCS_RATIO of the device) flushes at once; defer_cleanup, nested, holds every free
    and leaving it does not flush; frees queued inside it survive an exception."""
    needs_gpu("Numba")
    needs_module("numba.cuda")
    out = run(
        """
    import numpy as np
    from numba import cuda
    import emm
    ctx = emm.context(0)
    cuda.device_array(1)  # Numba's context, and emm's
    ctx.flush()
    for _ in range(10):
        a = cuda.device_array(16)
        del a
    assert ctx.pending == 10, ctx.pending
    b = cuda.device_array(16)
    del b
    assert ctx.pending == 0, ("the 11th free flushes", ctx.pending)
    free, total = ctx.get_memory_info()
    big = cuda.device_array(int(total * 0.21) // 8, dtype=np.float64)
    del big
    assert ctx.pending == 0, ("a free over the byte budget flushes", ctx.pending)
    with cuda.defer_cleanup():
        with cuda.defer_cleanup():
            for _ in range(20):
                c = cuda.device_array(16)
                del c
            assert ctx.pending == 20, ctx.pending
        assert ctx.pending == 20, ctx.pending
    assert ctx.pending == 20, ("leaving the guard does not flush", ctx.pending)
    ctx.flush()
    try:
        with cuda.defer_cleanup():
            d = cuda.device_array(16)
            del d
            raise ValueError("inside the guard")
    except ValueError:
        pass
    assert ctx.pending == 1, ("a free queued in the guard survives the exception", ctx.pending)
    ctx.flush()
    assert ctx.pending == 0
    print("deallocations ok")
    """,
        NUMBA_CUDA_MEMORY_MANAGER="emm.numba",
        EMM_MEMORY_MANAGER="default",
    )
    assert "deallocations ok" in out


@pytest.mark.parametrize("manager", ["default", "pool", "async-pool"])
def test_dlpack_round_trips_with_torch_and_cupy(manager):
    """A tensor made by PyTorch (and an array made by CuPy) is imported by emm and read back;
    an emm array is consumed by PyTorch and CuPy and read there; the producer's deleter runs
    once (CuPy's array is collected only after emm's view is gone)."""
    needs_gpu("PyTorch and CuPy")
    needs_module("torch")
    needs_module("cupy")
    out = run(
        """
    import gc, struct, sys, weakref
    import torch, cupy, emm
    ctx = emm.context(0)

    t = torch.arange(12, device="cuda", dtype=torch.float32).reshape(3, 4)
    a = ctx.from_dlpack(t)
    assert (a.shape, a.strides, a.dtype, a.ptr) == ([3, 4], [16, 4], "float32", t.data_ptr())
    assert a.read() == t.cpu().numpy().tobytes()
    torch.cuda.synchronize()

    c = cupy.arange(10, dtype=cupy.int64) * 3
    gone = weakref.ref(c)
    b = ctx.from_dlpack(c)
    assert b.read() == c.get().tobytes()
    del c
    gc.collect()
    assert gone() is not None, "emm's import holds CuPy's array"
    del b
    gc.collect()
    assert gone() is None, "the deleter ran: CuPy's array is collected"

    e = ctx.device_array((4, 5), "float64", order="F")
    e.write(struct.pack("20d", *range(20)))
    te = torch.from_dlpack(e)
    assert te.shape == (4, 5) and te.stride() == (1, 4) and te.data_ptr() == e.ptr
    assert te.sum().item() == sum(range(20))
    ce = cupy.from_dlpack(e)
    assert int(ce[3, 4]) == 19 and ce.data.ptr == e.ptr
    te.mul_(2)
    torch.cuda.synchronize()
    assert struct.unpack("20d", e.read()) == tuple(2.0 * i for i in range(20))
    del e, te, ce
    gc.collect()
    ctx.flush()
    print("dlpack ok", ctx.manager)
    """,
        EMM_MEMORY_MANAGER=manager,
    )
    assert "dlpack ok" in out


TORCH_GRAPH = """
    import json, sys
    import torch
    if sys.argv[1] == "emm":
        import emm.torch
        emm.torch.install()
    torch.manual_seed(0)
    x = torch.randn(512, 512, device="cuda")
    inputs = [torch.full((512, 512), i / 7, device="cuda") for i in range(7)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y = x @ x
            z = y.relu() + 1
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x @ x
        z = y.relu() + 1
    sums = []
    held = []
    for i in range(100):
        x.copy_(inputs[i % 7])
        g.replay()
        torch.cuda.synchronize()
        sums.append(float(z.double().sum()))
        free, total = torch.cuda.mem_get_info()
        held.append(total - free)
    print(json.dumps({"sums": sums, "held": [held[9], held[-1]]}))
    if sys.argv[1] == "emm":
        del g, y, z
        torch.cuda.synchronize()
        assert emm.torch.release_graph_pools() == 1
        assert emm.torch.last_error() is None, emm.torch.last_error()
"""


@pytest.mark.parametrize("manager", ["default", "pool", "vmm-pool", "async-pool"])
def test_torch_graph_capture_replays_as_pytorchs_own(manager):
    needs_gpu("torch.cuda.graph")
    needs_module("torch")
    import json

    def go(which):
        full = dict(os.environ, EMM_PYTHON_DRIVER="cuda", EMM_MEMORY_MANAGER=manager)
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(TORCH_GRAPH), which],
            capture_output=True,
            text=True,
            env=full,
            timeout=300,
        )
        assert out.returncode == 0, "stdout:\n%s\nstderr:\n%s" % (out.stdout, out.stderr)
        return json.loads(out.stdout.strip().splitlines()[-1])

    ours, theirs = go("emm"), go("torch")
    assert ours["sums"] == theirs["sums"], "results differ from PyTorch's own allocator"
    # Memory held stays flat over the replays.
    assert ours["held"][1] == ours["held"][0], ours["held"]


def test_cupy_stream_capture_launches():
    needs_gpu("CuPy stream capture")
    needs_module("cupy")
    run(
        """
    import cupy
    import emm, emm.cupy
    emm.cupy.install()
    x = cupy.arange(1 << 16, dtype=cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        y = x * 2
        z = y + 1
        del y
        g = s.end_capture()
    for i in range(100):
        x[:] = i
        g.launch(stream=s)
        s.synchronize()
        assert float(z[-1]) == 2 * i + 1, (i, float(z[-1]))
    del g, z
    cupy.cuda.Device().synchronize()
    assert emm.cupy.release_graph_pools() == 1
    """
    )


def test_torch_use_mem_pool_routes_every_thread_to_emm():
    needs_gpu("PyTorch's caching allocator over emm")
    needs_module("torch")
    run(
        """
    import torch
    import emm, emm.torch
    torch.manual_seed(0)
    lin = torch.nn.Linear(2048, 2048).cuda()
    x = torch.randn(128, 2048, device="cuda", requires_grad=True)
    before = torch.cuda.memory_reserved()
    with emm.torch.use_mem_pool() as pool:
        for _ in range(3):
            lin(x).relu().sum().backward()  # the backward runs on autograd's own thread
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before
        in_pool = sum(s["total_size"] for s in pool.snapshot())
    # Everything PyTorch reserved since came through emm, the backward's share included.
    assert grown > 0 and in_pool == grown, (grown, in_pool)
    # Each of the pool's segments is one live emm allocation.
    assert emm.torch.live() == len(pool.snapshot()), (emm.torch.live(), len(pool.snapshot()))
    # PyTorch's statistics answer (a pluggable allocator refuses them).
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] > 0
    assert emm.torch.last_error() is None, emm.torch.last_error()
    print("ok")
    """
    )


def test_torch_out_of_memory_in_an_emm_mem_pool_is_pytorchs_own():
    needs_gpu("PyTorch's caching allocator over emm")
    needs_module("torch")
    run(
        """
    import torch
    import emm, emm.torch
    with emm.torch.use_mem_pool():
        a = torch.ones(1 << 20, device="cuda")
        try:
            # Twice the device's memory, on any card.
            too_much = 2 * torch.cuda.get_device_properties(0).total_memory
            t = torch.empty(too_much, dtype=torch.uint8, device="cuda")
            raise SystemExit("no error: a tensor at 0x%x" % t.data_ptr())
        except torch.OutOfMemoryError:
            pass
        assert float(a.sum()) == 1 << 20
    print("ok")
    """
    )


def test_torch_compile_reduce_overhead_in_an_emm_mem_pool():
    needs_gpu("torch.compile")
    needs_module("torch")
    run(
        """
    import torch
    import emm.torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).cuda()
    x = torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        eager = model(x)
    with torch.no_grad(), emm.torch.use_mem_pool():
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(5):
            y = compiled(x)
        torch.cuda.synchronize()
    assert torch.allclose(y, eager, rtol=1e-5, atol=1e-5), (y - eager).abs().max()
    # The memory is emm's, and PyTorch's statistics see it.
    assert emm.torch.live() > 0
    assert torch.cuda.memory_stats()["reserved_bytes.all.current"] > 0
    assert emm.torch.last_error() is None, emm.torch.last_error()
    print("ok")
    """
    )


def test_torch_sleep_and_wake_keep_the_model():
    """emm.torch.sleep under vmm-pool: the weights (tagged) are offloaded, the inputs kept, the
    rest discarded; the device's free memory grows by what went back, and after the wake the
    model gives the same output at the same addresses."""
    needs_gpu("PyTorch")
    needs_module("torch")
    out = run(
        """
    import torch, emm, emm.torch
    emm.torch.install()
    torch.manual_seed(0)
    with emm.tag("weights"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, device="cuda") for _ in range(4)])
    with emm.tag("inputs"):
        x = torch.randn(64, 2048, device="cuda")
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    with torch.no_grad():
        before = model(x).cpu()
    ptrs = [p.data_ptr() for p in model.parameters()]
    free_awake = torch.cuda.mem_get_info()[0]
    r = emm.torch.sleep(offload=["weights"], keep=["inputs"], default="discard")
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert r["offloaded_bytes"] >= 4 * 2048 * 2048 * 4, r
    assert freed >= r["held_before_bytes"] - r["held_asleep_bytes"], (freed, r)
    try:
        torch.empty(1 << 20, device="cuda")
        raise SystemExit("an allocation was served while asleep")
    except RuntimeError as e:
        assert "asleep" in str(e), e
    w = emm.torch.wake()
    assert w["restored_bytes"] == r["offloaded_bytes"], (w, r)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    with torch.no_grad():
        assert torch.equal(model(x).cpu(), before)
    print("torch sleep ok", r["offload_seconds"], w["restore_seconds"])
    """,
        EMM_MEMORY_MANAGER="vmm-pool",
        EMM_MEMORY_ADAPTORS="history",
    )
    assert "torch sleep ok" in out
