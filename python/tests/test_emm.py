"""emm's Python bindings on their own: every test runs on the simulator (and on the GPU)."""

import ctypes
import os
import subprocess
import sys
import time

import pytest

import emm

from conftest import DRIVER, needs_gpu


@pytest.fixture
def ctx():
    c = emm.context(0)
    c.flush()
    return c


def run_python(code, **env):
    """Runs ``code`` in a fresh interpreter (its own emm runtime); returns the completed process."""
    full = {**os.environ, "EMM_PYTHON_DRIVER": DRIVER, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )


def test_device_memory_round_trip(ctx):
    buf = ctx.memalloc(4096)
    assert buf.size == 4096 and buf.device == 0 and buf.ptr != 0 and buf.live
    data = bytes(i % 251 for i in range(4096))
    ctx.copy_to_device(buf, data)
    assert ctx.copy_to_host(buf) == data
    assert ctx.copy_to_host(buf, n=16, offset=100) == data[100:116]


def test_release_ends_a_buffer(ctx):
    buf = ctx.memalloc(64)
    buf.release()
    assert not buf.live
    with pytest.raises(emm.EmmError, match="released"):
        ctx.copy_to_host(buf)


def test_frees_are_deferred_and_flushed(ctx):
    buf = ctx.memalloc(1000)
    del buf
    if ctx.manager == "default":
        assert ctx.pending == 1
    ctx.flush()
    assert ctx.pending == 0


def test_defer_cleanup_holds_frees_until_it_exits(ctx):
    if ctx.manager != "default":
        pytest.skip("counts the default manager's deferred cuMemFree calls")
    before = ctx.memalloc(100)
    with ctx.defer_cleanup():
        del before
        inside = ctx.memalloc(100)
        del inside
        ctx.flush()
        assert ctx.pending == 2, "frees inside the guard wait, even through a flush"
    assert ctx.pending == 2, "leaving the guard does not flush"
    ctx.flush()
    assert ctx.pending == 0


def test_a_deferral_entered_again_lasts_until_its_outermost_exit(ctx):
    """``with d: with d:`` on one object: the inner exit lets go of the inner entry only, so
    frees still wait until the outer one exits."""
    if ctx.manager != "default":
        pytest.skip("counts the default manager's deferred cuMemFree calls")
    ctx.flush()
    d = ctx.defer_cleanup()
    with d:
        with d:
            pass
        gone = ctx.memalloc(100)
        del gone
        ctx.flush()
        assert ctx.pending == 1, "the inner exit ended the deferral"
    ctx.flush()
    assert ctx.pending == 0


def test_pinned_and_mapped_host_memory(ctx):
    mapped = ctx.memhostalloc(256, mapped=True)
    assert mapped.device_ptr is not None and mapped.host_ptr != 0
    mapped.write(b"\x07" * 256)
    assert mapped.read(4, offset=252) == b"\x07" * 4
    pinned = ctx.memhostalloc(256)
    assert pinned.device_ptr is None
    pinned.write(b"ab", offset=10)
    assert pinned.read(2, offset=10) == b"ab"
    with pytest.raises(emm.EmmError, match="outside the 256-byte buffer"):
        pinned.write(b"x" * 300)


def test_mempin_holds_its_owner(ctx):
    owner = bytearray(8192)
    address = ctypes.addressof((ctypes.c_char * len(owner)).from_buffer(owner))
    pin = ctx.mempin(owner, address, len(owner), mapped=True)
    assert pin.device_ptr is not None
    pin.write(b"\x05" * 16)
    assert bytes(owner[:16]) == b"\x05" * 16
    pin.release()
    with pytest.raises(ValueError, match="null pointer"):
        ctx.mempin(owner, 0, 16)


def test_mempin_checks_the_range_against_the_owners_buffer(ctx):
    """A pin must lie within the memory its owner exports: 1 GiB over a 16-byte bytearray,
    a range that starts before the buffer or runs past its end are refused before the driver
    sees them; a range inside it pins."""
    owner = bytearray(16)
    address = ctypes.addressof((ctypes.c_char * len(owner)).from_buffer(owner))
    for pointer, size in [(address, 1 << 30), (address - 8, 16), (address + 8, 9), (1 << 63, 16)]:
        with pytest.raises(ValueError, match="reaches outside the 16 bytes the owner exports"):
            ctx.mempin(owner, pointer, size)
    pin = ctx.mempin(owner, address + 4, 8)
    pin.write(b"\x09" * 8)
    assert bytes(owner) == b"\0" * 4 + b"\x09" * 8 + b"\0" * 4
    pin.release()
    # A strided view spans its first to its last element.
    whole = (ctypes.c_int32 * 8)()
    view = memoryview(whole).cast("B").cast("i")[::2]
    start = ctypes.addressof(whole)
    ctx.mempin(view, start, 28).release()
    with pytest.raises(ValueError, match="reaches outside the 28 bytes"):
        ctx.mempin(view, start, 32)


def test_mempin_refuses_an_owner_that_says_nothing_and_keeps_read_only_memory_read_only(ctx):
    """An owner that exports no buffer cannot vouch for the range (any address of the process
    would do), so the pin is refused; memory pinned from a read-only owner (``bytes``) pins
    and reads, and refuses writes, which its owner does not allow."""
    owner = bytearray(64)
    address = ctypes.addressof((ctypes.c_char * len(owner)).from_buffer(owner))
    with pytest.raises(ValueError, match="exports no buffer"):
        ctx.mempin(object(), address, 64)
    data = bytes(range(64))
    start = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    pin = ctx.mempin(data, start, 64)
    assert pin.read_only and pin.read(4) == bytes(range(4))
    with pytest.raises(ValueError, match="read-only owner"):
        pin.write(b"\xff")
    assert data == bytes(range(64))
    pin.release()
    writable = ctx.mempin(owner, address, 64)
    assert not writable.read_only
    writable.release()


class _ProtocolStream:
    """A stream object as other libraries make them: the CUDA stream protocol."""

    def __init__(self, answer):
        self.answer = answer

    def __cuda_stream__(self):
        return self.answer


@pytest.mark.parametrize("bad", [12345, 3, 1 << 40, 0x7F00_0000_0000])
def test_raw_stream_handles_are_refused(ctx, bad):
    """An integer that is not an implicit stream never reaches the driver, which would
    dereference it: memalloc_on and the resources refuse it and say what to pass."""
    with pytest.raises(ValueError, match="raw handle emm cannot check.*ExternalStream"):
        ctx.memalloc_on(256, bad)
    mr = ctx.default_device_memory_resource()
    with pytest.raises(ValueError, match="raw handle emm cannot check"):
        mr.allocate(256, bad)
    buf = mr.allocate(256, 0)
    with pytest.raises(ValueError, match="raw handle emm cannot check"):
        mr.deallocate(buf, bad)
    assert buf.live, "a refused deallocate leaves the buffer alone"
    mr.deallocate(buf, 0)


def test_stream_arguments_that_are_no_streams_are_refused(ctx):
    with pytest.raises(ValueError, match="no handle"):
        ctx.memalloc_on(256, -1)
    with pytest.raises(TypeError, match="a str is no stream"):
        ctx.memalloc_on(256, "0")
    with pytest.raises(TypeError, match="a float is no stream"):
        ctx.memalloc_on(256, 0.0)
    with pytest.raises(ValueError, match="version 1 of the CUDA stream protocol"):
        ctx.memalloc_on(256, _ProtocolStream((1, 0)))
    with pytest.raises(TypeError, match="not \\(version, handle\\) integers"):
        ctx.memalloc_on(256, _ProtocolStream("stream"))
    with pytest.raises(ValueError, match="implicit default streams"):
        emm.ExternalStream(2)
    s = emm.ExternalStream(0xABC0)
    assert (s.handle, s.__cuda_stream__(), repr(s)) == (0xABC0, (0, 0xABC0), "emm.ExternalStream(0xabc0)")


@pytest.mark.parametrize("junk", [12345, 0xABC1, 1 << 50, (1 << 64) - 8])
def test_stream_objects_naming_no_possible_handle_are_refused(ctx, junk):
    """A stream object (or ExternalStream) is trusted for its handle, but one that cannot be
    the address of the driver's stream object (unaligned, or outside user space) is refused
    before the driver dereferences it."""
    with pytest.raises(ValueError, match="which no CUDA stream has"):
        ctx.memalloc_on(256, _ProtocolStream((0, junk)))
    with pytest.raises(ValueError, match="which no CUDA stream has"):
        emm.ExternalStream(junk)
    # The implicit streams stay as they were, through the protocol too.
    ctx.memalloc_on(256, _ProtocolStream((0, 2))).release()


def test_a_stream_object_outlives_the_memory_on_it():
    """The buffer holds the stream object it was allocated on (so another library's stream
    is not destroyed under it), and lets it go once the memory is freed."""
    code = (
        "import gc, weakref, emm\n"
        "emm.configure(manager='pool', driver='sim')\n"
        "c = emm.context(0)\n"
        "class S:\n"
        "    def __cuda_stream__(self):\n"
        "        return (0, 2)\n"
        "s = S()\n"
        "alive = weakref.ref(s)\n"
        "b = c.memalloc_on(4096, s)\n"
        "assert b.stream == 2\n"
        "del s\n"
        "gc.collect()\n"
        "assert alive() is not None, 'held by the buffer'\n"
        "b.release()\n"
        "del b\n"
        "c.flush()\n"
        "c.trim()\n"
        "gc.collect()\n"
        "assert alive() is None, 'let go once the memory is freed'\n"
        "print('ok')"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_managed_memory(ctx):
    m = ctx.memallocmanaged(512)
    m.write(bytes(range(256)) * 2)
    assert m.read(3, offset=255) == bytes([255, 0, 1])
    host_attached = ctx.memallocmanaged(64, attach_global=False)
    assert host_attached.size == 64


def test_reset_frees_everything(ctx):
    buf = ctx.memalloc(128)
    mapped = ctx.memhostalloc(128, mapped=True)
    ctx.reset()
    assert not buf.live
    with pytest.raises(emm.EmmError, match="reset"):
        ctx.copy_to_host(buf)
    with pytest.raises(emm.EmmError, match="reset"):
        mapped.write(b"x")
    fresh = ctx.memalloc(128)
    assert fresh.live


def test_zero_and_impossible_sizes_raise(ctx):
    with pytest.raises(emm.EmmError, match="0 bytes|zero"):
        ctx.memalloc(0)
    with pytest.raises(emm.OutOfMemoryError) as info:
        ctx.memalloc(1 << 62)
    assert isinstance(info.value, MemoryError)
    assert "out of memory" in str(info.value)


def test_memory_info(ctx):
    free, total = ctx.get_memory_info()
    assert 0 < free <= total


def test_ipc_handle_data(ctx):
    buf = ctx.memalloc(1024)
    if ctx.manager == "async-pool":
        with pytest.raises(emm.EmmError, match="async-pool-ipc"):
            ctx.get_ipc_handle(buf)
        return
    ipc = ctx.get_ipc_handle(buf, offset=256, size=512)
    assert ipc.size == 512 and len(ipc.handle) == 64
    assert ipc.offset >= 256
    # The driver refuses to open a handle in the process that exported it.
    with pytest.raises(emm.EmmError, match="cuIpcOpenMemHandle|original process|has not imported"):
        ctx.open_ipc(ipc.data)


def test_ipc_to_another_process(ctx):
    needs_gpu("another process of the simulator is another simulated machine")
    if ctx.manager.startswith("async-pool"):
        pytest.skip("the bindings do not pass stream-ordered pool exports between processes yet")
    buf = ctx.memalloc(1024)
    data = bytes(i % 13 for i in range(1024))
    ctx.copy_to_device(buf, data)
    ipc = ctx.get_ipc_handle(buf)
    code = (
        "import emm, sys; c = emm.context(0); b = c.open_ipc(bytes.fromhex(sys.argv[1])); "
        "sys.stdout.write(c.copy_to_host(b).hex()); b.release()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ipc.data.hex()],
        capture_output=True,
        text=True,
        env=dict(os.environ, EMM_PYTHON_DRIVER="cuda"),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout) == data


def test_one_runtime_per_process(ctx):
    settings = emm.settings()
    assert settings["driver"] == DRIVER
    emm.configure(driver=DRIVER)  # the same settings: nothing happens
    with pytest.raises(emm.EmmError, match="already exists"):
        emm.configure(manager="pool" if settings["manager"] != "pool" else "default", driver=DRIVER)
    rt = emm.Runtime(driver=DRIVER)
    assert rt.settings() == settings
    assert rt.context(0).device == 0


def test_unknown_manager_names_the_known_ones():
    out = run_python("import emm; emm.configure(manager='nope', driver='sim')")
    assert out.returncode != 0
    assert "EmmError" in out.stderr and "nope" in out.stderr and "default" in out.stderr


def test_unknown_driver_says_what_to_use():
    out = run_python("import emm; emm.configure(driver='opencl')")
    assert out.returncode != 0 and "cuda" in out.stderr and "sim" in out.stderr


def test_simulated_device_takes_a_size():
    code = (
        "import emm; emm.configure(manager='pool', driver='sim', sim_memory='80GiB')\n"
        "c = emm.context(0); free, total = c.get_memory_info()\n"
        "big = c.memalloc(60 << 30); c.copy_to_device(big, b'x' * 4096)\n"
        "print(total, emm.settings()['sim_memory'], c.copy_to_host(big, n=4) == b'xxxx')"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(80 << 30), str(80 << 30), "True"]
    # From the environment, as a runtime made at first use reads it.
    code = "import emm; c = emm.context(0); print(c.get_memory_info()[1], emm.settings()['sim_memory'])"
    out = run_python(code, EMM_PYTHON_DRIVER="sim", EMM_SIM_DEVICE_MEMORY="3GiB")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(3 << 30), str(3 << 30)]


def test_simulated_device_size_errors_say_what_to_do():
    out = run_python("import emm; emm.configure(driver='cuda', sim_memory='8GiB')")
    assert out.returncode != 0 and "ValueError" in out.stderr and 'driver="sim"' in out.stderr
    out = run_python("import emm; emm.configure(driver='sim', sim_memory='lots')")
    assert out.returncode != 0 and "ValueError" in out.stderr and "sim_memory" in out.stderr
    out = run_python("import emm; emm.configure(driver='sim', sim_memory=4096)")
    assert out.returncode != 0 and "at least 1 MiB" in out.stderr
    code = "import emm; emm.context(0)"
    out = run_python(code, EMM_PYTHON_DRIVER="sim", EMM_SIM_DEVICE_MEMORY="big")
    assert out.returncode != 0 and "EMM_SIM_DEVICE_MEMORY" in out.stderr and "unset it" in out.stderr


def test_stats_adaptor_counts_every_kind():
    code = (
        "import emm; emm.configure(adaptors='stats', driver='sim'); c = emm.context(0)\n"
        "d = c.memalloc(100); m = c.memallocmanaged(64); h = c.memhostalloc(32, mapped=True)\n"
        "u = c.usage(); print(u['device']['current_bytes'], u['managed']['current_bytes'], "
        "u['mapped']['current_bytes'])"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["100", "64", "32"]


def test_usage_is_none_without_the_stats_adaptor(ctx):
    if emm.settings()["adaptors"] is None and "stats" not in os.environ.get("EMM_MEMORY_ADAPTORS", ""):
        assert ctx.usage() is None


def test_pool_stats_and_trim(ctx):
    stats = ctx.pool_stats()
    assert set(stats) == {"device", "pinned_host"}


def test_pool_stats_name_every_figure():
    """Under `pool` (a fresh interpreter), the device pool's dict has every documented figure;
    a stream that takes back what it freed itself waits for nothing (the waits' counting is the
    Rust suite's: a busy stream's work is not made from here)."""
    code = (
        "import emm; emm.configure(manager='pool', driver='sim'); c = emm.context(0)\n"
        "x = c.memalloc_on(64 << 20, 2)\n"
        "del x\n"
        "y = c.memalloc_on(64 << 20, 2)\n"
        "d = c.pool_stats()['device']\n"
        "print(' '.join(sorted(d)))\n"
        "print(d['stream_waits'], d['host_waits'])"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    names, waits = out.stdout.splitlines()
    assert names.split() == sorted([
        "held_bytes", "in_use_bytes", "in_use_blocks", "cached_bytes", "peak_held_bytes",
        "chunks", "grows", "driver_allocations", "driver_frees", "stream_waits", "host_waits",
        "trimmed_bytes", "largest_free_bytes",
    ])
    assert waits.split() == ["0", "0"], out.stdout


@pytest.mark.parametrize("manager", ["default", "pool"])
def test_trim_gives_back_exactly_what_the_pool_held(manager):
    """A fresh interpreter each: under `pool`, trim returns the bytes the pool held with
    nothing in use, and it holds none after; `default` holds nothing and trims nothing."""
    code = (
        f"import emm; emm.configure(manager={manager!r}, driver='sim'); c = emm.context(0)\n"
        "bufs = [c.memalloc(3 << 20) for _ in range(4)]\n"
        "del bufs; c.flush()\n"
        "dev = c.pool_stats()['device']\n"
        "held = dev['held_bytes'] if dev else 0\n"
        "trimmed = c.trim()\n"
        "after = c.pool_stats()['device']\n"
        "print(held, trimmed, after['held_bytes'] if after else 0)"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    held, trimmed, after = map(int, out.stdout.split())
    if manager == "pool":
        assert held >= 12 << 20 and trimmed == held and after == 0, out.stdout
    else:
        assert (held, trimmed, after) == (0, 0, 0), out.stdout


@pytest.mark.parametrize("manager", ["default", "pool", "async-pool"])
def test_memalloc_on_a_stream(manager):
    """Memory on a stream, per manager (a fresh interpreter each): the buffer knows its
    stream, the manager says how it orders reuse, the per-thread default stream works too."""
    code = (
        "import emm\n"
        f"emm.configure(manager={manager!r}, driver='sim')\n"
        "c = emm.context(0)\n"
        "b = c.memalloc_on(4096, 0)\n"
        "assert b.stream == 0 and b.size == 4096\n"
        "c.copy_to_device(b, bytes(range(256)) * 16)\n"
        "assert bytes(c.copy_to_host(b)) == bytes(range(256)) * 16\n"
        "p = c.memalloc_on(100, 2)\n"
        "assert p.stream == 2\n"
        "assert c.memalloc(64).stream is None\n"
        "print(c.stream_ordering())"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    expected = {"default": "fenced", "pool": "per-stream", "async-pool": "driver"}[manager]
    assert out.stdout.strip() == expected


def test_device_memory_resource(ctx):
    """cuda.core's DeviceMemoryResource through emm: a limited pool of its own, buffers on a
    stream, the pool's figures, deallocate, close; the default pool, which emm does not own."""
    # A multiple of 32 MiB: the driver rounds a pool's limit up to one (measured on an H100).
    mr = ctx.device_memory_resource(max_size=64 << 20)
    assert mr.is_handle_owned and not mr.is_ipc_enabled and mr.device_id == 0
    a = mr.allocate(48 << 20, 0)
    assert a.stream == 0 and a.size == 48 << 20
    ctx.copy_to_device(a, b"\x07" * 64)
    assert bytes(ctx.copy_to_host(a, 64)) == b"\x07" * 64
    with pytest.raises(emm.EmmError, match="max_size"):
        mr.allocate(24 << 20, 0)
    at = mr.attributes()
    assert at["used_current"] >= 48 << 20 and at["used_high"] >= at["used_current"], at
    assert at["reserved_current"] <= 64 << 20, at
    mr.deallocate(a, 0)
    with pytest.raises(emm.EmmError, match="released"):
        ctx.copy_to_host(a, 64)
    assert mr.live_buffers() == 0
    mr.reset_high_water()
    mr.close()
    with pytest.raises(emm.EmmError, match="closed"):
        mr.allocate(64, 0)
    d = ctx.default_device_memory_resource()
    assert not d.is_handle_owned
    b = d.allocate(4096)
    b.release()
    d.close()


def test_pinned_memory_resource(ctx):
    """cuda.core's PinnedMemoryResource through emm: host buffers from a pool in host memory,
    one address for the host and the device; NUMA placement when IPC is enabled."""
    mr = ctx.pinned_memory_resource()
    assert mr.numa_id is None and not mr.is_ipc_enabled
    h = mr.allocate(4096, 0)
    assert h.device_ptr == h.host_ptr and h.size == 4096
    h.write(b"\x05" * 32)
    d = ctx.memalloc(32)
    ctx.copy_to_device(d, h.read(32))
    assert bytes(ctx.copy_to_host(d)) == b"\x05" * 32
    assert mr.attributes()["used_current"] >= 4096
    mr.deallocate(h, 0)
    with pytest.raises(emm.EmmError, match="released"):
        mr.deallocate(h, 0)
    mr.close()
    assert ctx.pinned_memory_resource(ipc_enabled=True).numa_id is not None


def test_managed_memory_resource(ctx):
    """cuda.core's ManagedMemoryResource through emm: managed buffers from a managed pool, one
    address for the host and the device, freed by release or deallocate on a stream;
    preferred locations checked."""
    mr = ctx.managed_memory_resource()
    m = mr.allocate(4096, 0)
    m.write(b"\x09" * 16)
    d = ctx.memalloc(16)
    ctx.copy_to_device(d, m.read(16))
    assert bytes(ctx.copy_to_host(d)) == b"\x09" * 16
    assert mr.attributes()["used_current"] >= 4096
    m.release()
    n = mr.allocate(8192, 0)
    mr.deallocate(n, 0)
    with pytest.raises(emm.EmmError, match="released already"):
        mr.deallocate(n, 0)
    mr.close()
    ctx.managed_memory_resource("device", 0).close()
    with pytest.raises(ValueError, match="preferred location"):
        ctx.managed_memory_resource("device", None)


def test_torch_entry_points_without_torch():
    """PyTorch's C entry points, called as PyTorch calls them (through ctypes here)."""
    lib = ctypes.CDLL(emm._emm.__file__)
    lib.emm_torch_malloc.restype = ctypes.c_void_p
    lib.emm_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.emm_torch_free.restype = None
    lib.emm_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    emm._emm.torch_last_error()
    before = emm._emm.torch_live()
    p = lib.emm_torch_malloc(4096, 0, None)
    assert p and emm._emm.torch_live() == before + 1
    lib.emm_torch_free(p, 4096, 0, None)
    assert emm._emm.torch_live() == before and emm._emm.torch_last_error() is None
    # A free with the wrong size is reported (and frees); a foreign pointer frees nothing.
    q = lib.emm_torch_malloc(100, 0, None)
    lib.emm_torch_free(q, 99, 0, None)
    assert "allocated with 100 bytes" in emm._emm.torch_last_error()
    lib.emm_torch_free(0x1234, 8, 0, None)
    assert "did not allocate" in emm._emm.torch_last_error()
    # An empty buffer is the null pointer, without the manager; freeing it does nothing.
    assert not lib.emm_torch_malloc(0, 0, None)
    lib.emm_torch_free(None, 0, 0, None)
    assert emm._emm.torch_last_error() is None
    # The MemPool route's malloc returns null on failure (PyTorch's caching allocator checks)
    # and says why.
    lib.emm_torch_pool_malloc.restype = ctypes.c_void_p
    lib.emm_torch_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert not lib.emm_torch_pool_malloc(-1, 0, None)
    assert "negative size" in emm._emm.torch_last_error()
    assert not lib.emm_torch_pool_malloc(1 << 62, 0, None)
    assert "out of memory" in emm._emm.torch_last_error()


def test_torch_malloc_throws_a_cpp_exception_on_failure():
    """install()'s malloc throws a C++ exception carrying emm's message (PyTorch turns it
    into a RuntimeError; its pluggable allocator does not check for a null pointer). Called
    through ctypes, which cannot catch it, the process ends with the C++ runtime's report."""
    out = run_python(
        "import ctypes, emm\n"
        "lib = ctypes.CDLL(emm._emm.__file__)\n"
        "lib.emm_torch_malloc.restype = ctypes.c_void_p\n"
        "lib.emm_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
        "lib.emm_torch_malloc(1 << 62, 0, None)\n"
        "print('returned')\n"
    )
    assert out.returncode != 0 and "returned" not in out.stdout, out
    assert "std::runtime_error" in out.stderr, out.stderr
    assert "malloc of 4611686018427387904 bytes on device 0: out of memory" in out.stderr


def test_no_driver_library_is_a_clear_error():
    import ctypes.util

    if DRIVER == "cuda" or ctypes.util.find_library("cuda"):
        pytest.skip("libcuda is present here: this checks a machine without the NVIDIA driver")
    out = run_python("import emm; emm.configure(driver='cuda'); emm.context(0)")
    assert out.returncode != 0
    assert "EmmError" in out.stderr and "libcuda" in out.stderr, out.stderr


def test_threads_allocate_and_free_concurrently(ctx):
    """The bindings release the GIL around emm calls: threads allocating, copying and freeing
    at once neither deadlock nor lose memory."""
    import threading

    errors = []

    def work(seed):
        try:
            for i in range(200):
                b = ctx.memalloc(256 + (i % 7) * 64)
                ctx.copy_to_device(b, bytes([seed]) * 16)
                assert ctx.copy_to_host(b, n=16) == bytes([seed]) * 16
                b.release()
                if i % 50 == 0:
                    ctx.flush()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors
    ctx.flush()


def run_with_cupy_stub(code):
    """Runs ``code`` with the stand-in for CuPy (tests/stubs/cupy); it must print only ok."""
    stubs = os.path.join(os.path.dirname(__file__), "stubs")
    out = run_python(code, PYTHONPATH=stubs + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok", out.stdout


def test_cupy_allocator_on_the_simulator():
    """emm.cupy's allocator over a stand-in for CuPy's hooks (tests/stubs/cupy): the
    pointer's owner keeps the emm buffer alive, it is allocated on CuPy's current stream,
    0 bytes is a null pointer with no allocation, an allocation too large raises emm's
    OutOfMemoryError and holds nothing, and the memory goes back when CuPy's pointer goes."""
    code = (
        "import gc, emm, emm.cupy, cupy\n"
        "emm.configure(adaptors='stats', driver='sim')\n"
        "emm.cupy.install(c_functions=False)\n"
        "p = cupy.cuda.alloc(1000)\n"
        "c = emm.context(0)\n"
        "assert p.ptr != 0 and p.mem.size == 1000 and p.mem.owner.live\n"
        "assert c.usage()['device']['current_count'] == 1\n"
        "assert p.mem.owner.stream == 0, 'on the current (legacy) stream'\n"
        "cupy.cuda.current_stream = cupy.cuda.Stream(2)\n"
        "q = cupy.cuda.alloc(1000)\n"
        "assert q.mem.owner.stream == 2, 'on the per-thread stream'\n"
        "del q; gc.collect()\n"
        "z = cupy.cuda.alloc(0)\n"
        "assert z.ptr == 0 and c.usage()['device']['current_count'] == 1\n"
        "try:\n"
        "    cupy.cuda.alloc(1 << 50)\n"
        "    raise SystemExit('1 PiB was allocated')\n"
        "except emm.OutOfMemoryError as e:\n"
        "    assert 'out of' in str(e).lower(), e\n"
        "assert c.usage()['device']['current_count'] == 1\n"
        "del p; gc.collect()\n"
        "assert c.usage()['device']['current_count'] == 0\n"
        "print('ok')"
    )
    run_with_cupy_stub(code)


def test_snapshot_with_history_on_the_simulator():
    """Context.snapshot() under the history adaptor: the in-use blocks are the live
    allocations, tagged by emm.tag and by emm.cupy's C allocator; the PyTorch-format export
    round-trips through pickle as memory_viz reads it; the HTML page is written; and the
    out-of-memory error names the largest holders by tag."""
    code = (
        "import gc, os, pickle, tempfile, emm, emm.cupy, cupy\n"
        "emm.configure(adaptors='history', driver='sim', manager='pool')\n"
        "emm.cupy.install()\n"
        "c = emm.context(0)\n"
        "p = cupy.cuda.alloc(1000)\n"
        "with emm.tag('loader'):\n"
        "    b = c.memalloc(3 << 20)\n"
        "q = c.memalloc(5000)\n"
        "s = c.snapshot()\n"
        "assert s.history_on and s.manager == 'history(pool)', s\n"
        "tags = {t['tag']: (t['bytes'], t['allocations']) for t in s.by_tag()}\n"
        "assert tags == {'cupy': (1000, 1), 'loader': (3 << 20, 1), 'untagged': (5000, 1)}, tags\n"
        "used = [k for g in s.segments() for k in g['blocks'] if k['state'] == 'in-use']\n"
        "assert {k['address'] for k in used} == {p.ptr, b.ptr, q.ptr}, used\n"
        "assert all('tag' in k for k in used)\n"
        "assert s.held_bytes == sum(g['bytes'] for g in s.segments())\n"
        "assert s.held_bytes == c.pool_stats()['device']['held_bytes']\n"
        "d = s.to_torch()\n"
        "assert len(d['segments']) == len(s.segments()) and len(d['device_traces'][0]) == 3\n"
        "assert d['device_traces'][0][1]['action'] == 'alloc', d['device_traces']\n"
        "with tempfile.TemporaryDirectory() as t:\n"
        "    s.dump_torch(os.path.join(t, 'snap.pickle'))\n"
        "    with open(os.path.join(t, 'snap.pickle'), 'rb') as f:\n"
        "        assert pickle.load(f) == d\n"
        "    s.save_html(os.path.join(t, 'snap.html'))\n"
        "    with open(os.path.join(t, 'snap.html')) as f:\n"
        "        assert f.read().count('<svg') == len(d['segments'])\n"
        "try:\n"
        "    c.memalloc(1 << 40)\n"
        "    raise SystemExit('1 TiB was allocated')\n"
        "except emm.OutOfMemoryError as e:\n"
        "    assert 'live memory by tag: loader 3.0 MiB in 1 allocation' in str(e), str(e)\n"
        "assert c.snapshot().to_torch()['device_traces'][0][-1]['action'] == 'oom'\n"
        "print('ok')"
    )
    run_with_cupy_stub(code)


SLEEP_PROGRAM = """
import emm
c = emm.context(0)
MIB = 1 << 20
with emm.tag("weights"):
    w = c.memalloc(24 * MIB)
with emm.tag("kv-cache"):
    kv = c.memalloc(16 * MIB)
    arr = c.device_array((MIB,), "uint8")
with emm.tag("state"):
    keep = c.memalloc(3 * MIB)
scratch = c.memalloc(5 * MIB)
data = bytes(i % 251 for i in range(24 * MIB))
c.copy_to_device(w, data)
c.copy_to_device(keep, b"k" * (3 * MIB))
free_before = c.get_memory_info()[0]
r = c.sleep(offload=["weights"], discard=["kv-cache"], keep=["state"], default="discard")
assert c.is_asleep
assert r["offloaded_bytes"] == 24 * MIB and r["kept_bytes"] == 3 * MIB, r
assert r["discarded_bytes"] == 22 * MIB, r
assert r["held_asleep_bytes"] < r["held_before_bytes"], r
assert c.get_memory_info()[0] - free_before >= r["held_before_bytes"] - r["held_asleep_bytes"], r
for what, call in [
    ("allocation", lambda: c.memalloc(MIB)),
    ("copy", lambda: c.copy_to_host(w, n=16)),
    ("second sleep", lambda: c.sleep()),
    ("DLPack export", lambda: arr.__dlpack__()),
]:
    try:
        call()
        raise SystemExit(what + " was not refused while asleep")
    except emm.EmmError as e:
        assert "asleep" in str(e), (what, str(e))
assert c.copy_to_host(keep, n=4) == b"kkkk", "kept memory stays usable"
try:
    c.sleep(offload=["weights"], discard=["weights"])
    raise SystemExit("a tag under two choices was taken")
except ValueError as e:
    assert "one choice" in str(e), str(e)
woke = emm.wake()
assert not c.is_asleep
assert woke["restored_bytes"] == 24 * MIB, woke
assert woke["held_after_bytes"] == r["held_before_bytes"], (woke, r)
assert c.copy_to_host(w) == data, "offloaded: bit for bit"
c.copy_to_device(kv, b"x" * 16)
assert c.copy_to_host(kv, n=16) == b"x" * 16
c.memalloc(MIB)
# A kept host buffer serves the next sleep; the weights come back each time.
first = emm.sleep(offload=["weights"], default="discard", keep_host_buffer=True)
assert not first["host_buffer_reused"], first
emm.wake()
again = emm.sleep(offload=["weights"], default="discard", keep_host_buffer=True)
assert again["host_buffer_reused"], again
emm.wake()
assert c.copy_to_host(w) == data, "offloaded twice through one buffer: bit for bit"
c.trim()
print("sleep ok", round(r["seconds"], 4), round(woke["seconds"], 4))
"""


def test_sleep_and_wake_by_tag():
    """emm.sleep / emm.wake under vmm-pool with the history adaptor: each tag's choice, the
    memory given back, the refusals while asleep, and the offloaded bytes back bit for bit.
    Runs on the simulator and, in the GPU job, on the GPU."""
    out = run_python(SLEEP_PROGRAM, EMM_MEMORY_MANAGER="vmm-pool", EMM_MEMORY_ADAPTORS="history")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "sleep ok" in out.stdout


def test_sleep_is_refused_outside_vmm_pool():
    """Other managers refuse with advice and stay awake; choices by tag without the history
    adaptor are refused before anything goes back."""
    out = run_python(
        "import emm\n"
        "c = emm.context(0)\n"
        "b = c.memalloc(1 << 20)\n"
        "try:\n"
        "    emm.sleep()\n"
        "    raise SystemExit('pool slept')\n"
        "except emm.EmmError as e:\n"
        "    assert 'vmm-pool' in str(e), str(e)\n"
        "assert not c.is_asleep\n"
        "c.memalloc(1 << 20)\n"
        "print('refused ok')",
        EMM_MEMORY_MANAGER="pool",
    )
    assert "refused ok" in out.stdout, out.stderr
    out = run_python(
        "import emm\n"
        "c = emm.context(0)\n"
        "b = c.memalloc(1 << 20)\n"
        "try:\n"
        "    emm.sleep(offload=['weights'], default='discard')\n"
        "    raise SystemExit('slept by tag without history')\n"
        "except emm.EmmError as e:\n"
        "    assert 'EMM_MEMORY_ADAPTORS=history' in str(e), str(e)\n"
        "assert not c.is_asleep\n"
        "print('history ok')",
        EMM_MEMORY_MANAGER="vmm-pool",
    )
    assert "history ok" in out.stdout, out.stderr


def test_snapshot_stacks_name_the_python_caller():
    """With history-stacks, a block's stack starts with the Python frames that allocated it
    (innermost first), and PyTorch's export gives them their file, line and name."""
    code = (
        "import emm\n"
        "emm.configure(adaptors='history-stacks', driver='sim', manager='pool')\n"
        "c = emm.context(0)\n"
        "def my_alloc_site():\n"
        "    return c.memalloc(4096)\n"
        "b = my_alloc_site()\n"
        "s = c.snapshot()\n"
        "blk = [k for g in s.segments() for k in g['blocks'] if k['address'] == b.ptr][0]\n"
        "assert blk['stack'].startswith('File \"<string>\", line 5, in my_alloc_site'), blk['stack'][:300]\n"
        "d = s.to_torch()\n"
        "frames = [k for g in d['segments'] for k in g['blocks'] if k['address'] == b.ptr][0]['frames']\n"
        "assert frames[0] == {'filename': '<string>', 'line': 5, 'name': 'my_alloc_site'}, frames[:2]\n"
        "assert frames[1]['name'] == '<module>', frames[:2]\n"
        "print('ok')"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok", out.stdout


def test_cupy_c_allocator_on_the_simulator():
    """emm.cupy's C functions through a stand-in for CuPy's CFunctionAllocator and its
    current-stream export (tests/stubs/cupy): CuPy's current stream is read in C, the bytes
    are counted, memory allocated on one thread is freed on another, an allocation too large
    raises emm's OutOfMemoryError, and the memory goes back when CuPy's pointer goes."""
    code = (
        "import gc, emm, emm.cupy, cupy\n"
        "emm.configure(adaptors='stats', driver='sim', manager='pool')\n"
        "emm.cupy.install()\n"
        "c = emm.context(0)\n"
        "p = cupy.cuda.alloc(1000)\n"
        "assert p.ptr != 0 and c.usage()['device']['current_count'] == 1\n"
        "assert emm.cupy.used_bytes() == 1000, emm.cupy.used_bytes()\n"
        "assert emm.cupy.total_bytes() == c.pool_stats()['device']['held_bytes'] > 0\n"
        "cupy.cuda.current_stream = cupy.cuda.Stream(2)\n"
        "q = cupy.cuda.alloc(5000)\n"
        "assert emm.cupy.used_bytes() == 6000\n"
        "import threading\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(cupy.cuda.alloc(300)))\n"
        "t.start(); t.join()\n"
        "assert emm.cupy.used_bytes() == 6300\n"
        "box.clear()\n"
        "assert emm.cupy.used_bytes() == 6000, 'freed on another thread than its own'\n"
        "try:\n"
        "    cupy.cuda.alloc(1 << 50)\n"
        "    raise SystemExit('1 PiB was allocated')\n"
        "except emm.OutOfMemoryError as e:\n"
        "    assert 'out of memory' in str(e), e\n"
        "del p, q; gc.collect()\n"
        "assert emm.cupy.used_bytes() == 0 and c.usage()['device']['current_count'] == 0\n"
        "assert emm.cupy.free_all_blocks() > 0 and emm.cupy.total_bytes() == 0\n"
        "print('ok')"
    )
    run_with_cupy_stub(code)


def test_arrays_speak_dlpack(ctx):
    """emm.Array through DLPack into emm again (both ABIs): the same memory and bytes; the
    import holds the exporter's memory after the exporter is gone; an unconsumed capsule frees
    what it held; a capsule is used once; bad arguments are refused with a reason."""
    import struct

    a = ctx.device_array((3, 4), "float32", order="F")
    assert (a.shape, a.strides, a.dtype, a.nbytes) == ([3, 4], [4, 12], "float32", 48)
    data = struct.pack("12f", *[i * 0.5 for i in range(12)])
    a.write(data)
    assert a.__dlpack_device__() == (2, ctx.device)

    class Producer:
        """Hands out `a`'s capsule the way a framework would (legacy when asked to)."""

        def __init__(self, legacy):
            self.legacy = legacy

        def __dlpack__(self, stream=None, max_version=None):
            if self.legacy:
                if max_version is not None:
                    raise TypeError("an old producer: no max_version")
                return a.__dlpack__(stream=stream)
            return a.__dlpack__(stream=stream, max_version=max_version)

    for legacy in (False, True):
        b = ctx.from_dlpack(Producer(legacy))
        assert (b.shape, b.strides, b.dtype, b.ptr) == (a.shape, a.strides, "float32", a.ptr)
        assert b.read() == data
    b = ctx.from_dlpack(Producer(False))
    del a
    ctx.flush()
    assert b.read() == data, "the import keeps the exported memory"

    before = ctx.get_memory_info()[0]
    c = ctx.device_array((1 << 20,), "uint8")
    cap = c.__dlpack__(max_version=(1, 0))
    del c
    ctx.flush()
    del cap  # never consumed: its destructor gives the memory back
    ctx.flush()
    assert ctx.get_memory_info()[0] == before

    class Twice:
        def __init__(self):
            self.cap = b.__dlpack__()

        def __dlpack__(self, stream=None, max_version=None):
            return self.cap

    t = Twice()
    ctx.from_dlpack(t)
    with pytest.raises(ValueError, match="used once"):
        ctx.from_dlpack(t)
    with pytest.raises(ValueError, match="unknown dtype"):
        ctx.device_array((2,), "float8")
    with pytest.raises(BufferError, match="without copying"):
        b.__dlpack__(copy=True)
    empty = ctx.device_array((0, 5), "int64")
    assert (empty.ptr, empty.read()) == (0, b"")


def test_capture_pools_leave_ordinary_allocations_alone(ctx):
    # With capture pools on and no stream captured, memalloc_on comes from the manager as
    # before, frees go back, and there is no ended capture's pool to let go.
    emm.enable_capture_pools()
    buf = ctx.memalloc_on(4096, 0)
    assert buf.stream == 0 and buf.live
    buf.release()
    ctx.flush()
    assert not buf.live
    assert emm.release_capture_pools() == 0


def test_out_of_memory_callback_frees_and_the_allocation_is_retried():
    if DRIVER == "cuda":
        pytest.skip(
            "fills a 64 MiB simulated device (EMM_SIM_DEVICE_MEMORY); the Rust suite's "
            "out-of-memory tests and the PyTorch statistics test run on the GPU"
        )
    out = run_python(
        """
import emm
ctx = emm.context(0)
spare = [ctx.memalloc(40 << 20)]
asked = []
def free_spare(nbytes):
    asked.append(nbytes)
    return bool(spare and spare.pop() is not None)
ctx.on_out_of_memory(free_spare)
buf = ctx.memalloc(40 << 20)
assert asked == [40 << 20] and not spare, asked
assert ctx.allocation_events()["ooms"] == 0
assert ctx.allocation_events()["retries"] >= 1
# A callback that frees nothing is asked three times, then the error says so.
ctx.on_out_of_memory(lambda n: asked.append(n) or True)
try:
    ctx.memalloc(100 << 20)
    raise SystemExit("no error")
except emm.OutOfMemoryError as e:
    text = str(e)
assert len(asked) == 4, asked
assert "asked for 3 retries" in text and "manager `" in text, text
assert ctx.allocation_events()["ooms"] == 1
# An exception in the callback counts as false: one call, no retry.
def broken(n):
    raise ValueError("broken callback")
ctx.on_out_of_memory(broken)
try:
    ctx.memalloc(100 << 20)
except emm.OutOfMemoryError as e:
    assert "retries" not in str(e), str(e)
# A callback that allocates: its own allocation that runs out of memory does not call it
# again (it recursed until the stack overflowed); it raises, saying why.
inner = []
def allocating(n):
    try:
        ctx.memalloc(n)
    except emm.OutOfMemoryError as e:
        inner.append(str(e))
    return False
ctx.on_out_of_memory(allocating)
try:
    ctx.memalloc(100 << 20)
    raise SystemExit("no error")
except emm.OutOfMemoryError as e:
    assert "inside the out-of-memory callback" not in str(e), str(e)
assert len(inner) == 1 and "inside the out-of-memory callback" in inner[0], inner
ctx.on_out_of_memory(None)
print("ok")
""",
        EMM_SIM_DEVICE_MEMORY=str(64 << 20),
        EMM_MEMORY_MANAGER="pool",
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    assert "broken callback" in out.stderr, out.stderr


# A stand-in for PyTorch where it is not installed: emm.torch's statistics need only its
# device index helpers.
TORCH_STUB = """
import sys, types
if "torch" not in sys.modules:
    try:
        import torch
    except ImportError:
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(
            current_device=lambda: 0,
            _utils=types.SimpleNamespace(_get_device_index=lambda d, optional=True: int(d)),
        )
        sys.modules["torch"] = torch
"""


def test_torch_memory_stats_count_what_pytorch_allocated():
    if DRIVER == "cuda":
        pytest.skip("drives emm.torch's C entry points on the simulator; the GPU job runs PyTorch")
    out = run_python(
        TORCH_STUB
        + """
import ctypes
import emm, emm.torch
lib = ctypes.CDLL(emm._emm.__file__)
lib.emm_torch_malloc.restype = ctypes.c_void_p
lib.emm_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.emm_torch_free.restype = None
lib.emm_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.emm_torch_pool_malloc.restype = ctypes.c_void_p
lib.emm_torch_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
a = lib.emm_torch_malloc(1 << 20, 0, None)
b = lib.emm_torch_malloc(3 << 20, 0, None)
lib.emm_torch_free(a, 1 << 20, 0, None)
st = emm.torch.memory_stats()
assert st["allocated_bytes.all.current"] == 3 << 20, st
assert st["allocated_bytes.all.peak"] == 4 << 20, st
assert st["allocated_bytes.all.allocated"] == 4 << 20, st
assert st["allocated_bytes.all.freed"] == 1 << 20, st
assert st["allocation.all.current"] == 1 and st["allocation.all.peak"] == 2, st
assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"]
held = emm.context(0).pool_stats()["device"]["held_bytes"]
assert st["reserved_bytes.all.current"] == held >= 3 << 20, st
assert emm.torch.memory_allocated() == 3 << 20
assert emm.torch.max_memory_allocated(0) == 4 << 20
emm.torch.reset_peak_memory_stats()
assert emm.torch.max_memory_allocated() == 3 << 20
assert emm.torch.memory_reserved() == held
# A failure for lack of memory counts in num_ooms.
assert not lib.emm_torch_pool_malloc(1 << 40, 0, None)
assert emm.torch.memory_stats()["num_ooms"] == 1
summary = emm.torch.memory_summary()
assert "manager pool" in summary and "3.0 MiB" in summary, summary
lib.emm_torch_free(b, 3 << 20, 0, None)
assert emm.torch.memory_allocated() == 0
assert emm.torch.empty_cache() > 0
assert emm.torch.memory_reserved() == emm.context(0).pool_stats()["device"]["held_bytes"]
print("ok")
""",
        EMM_MEMORY_MANAGER="pool",
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_free_space_of_the_pool():
    out = run_python(
        """
import emm
ctx = emm.context(0)
if ctx.manager != "pool":
    raise SystemExit("not pool")
bufs = [ctx.memalloc(1 << 20) for _ in range(8)]
del bufs[::2]
space = ctx.free_space(request=2 << 20)
assert space["blocks"] >= 1 and space["total_bytes"] >= 4 << 20, space
stats = ctx.pool_stats()["device"]
assert space["total_bytes"] == stats["held_bytes"] - stats["in_use_bytes"], (space, stats)
assert space["largest_bytes"] == stats["largest_free_bytes"]
assert sum(c for _, c, _ in space["histogram"]) == space["blocks"]
assert 0.0 <= space["fragmentation"] <= 1.0
assert "unusable_bytes" in space and "unusable_bytes" not in ctx.free_space()
print("ok")
""",
        EMM_MEMORY_MANAGER="pool",
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    out = run_python("import emm; print(emm.context(0).free_space())", EMM_MEMORY_MANAGER="default")
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stdout + out.stderr


def test_device_array_takes_dtypes_as_numpy_does(ctx):
    """Names, type strings, one-letter codes, NumPy dtypes and scalar types (stand-ins here;
    the real NumPy where it is installed) give the same array type; big-endian is refused."""

    class Dtype:  # numpy.dtype's two attributes emm reads
        def __init__(self, typestr, name):
            self.str, self.name = typestr, name

    class float64:  # noqa: N801 - a scalar type is known by its __name__
        pass

    forms = ["float64", "float", "double", "d", "f8", "<f8", "=f8", Dtype("<f8", "float64"),
             float64, float]
    for form in forms:
        assert ctx.device_array((2,), form).dtype == "float64", form
    for form, name in [("i4", "int32"), ("|u1", "uint8"), ("?", "bool"), ("|b1", "bool"),
                       ("c8", "complex64"), ("e", "float16"), (int, "int64"), (bool, "bool"),
                       (complex, "complex128"), (Dtype("<V2", "bfloat16"), "bfloat16")]:
        assert ctx.device_array((2,), form).dtype == name, form
    for bad, says in [(">f8", "big-endian"), (Dtype(">f8", "float64"), "big-endian"),
                      ("f3", "unknown dtype"), ("x8", "unknown dtype"), ("", "unknown dtype"),
                      (3.5, "dtype 3.5")]:
        with pytest.raises(ValueError, match=says):
            ctx.device_array((2,), bad)
    try:
        import numpy as np
    except ImportError:
        return  # the stand-ins above are NumPy's interface; the GPU job has NumPy
    for form in [np.float32, np.dtype("f4"), np.dtype("<f4"), "float32"]:
        assert ctx.device_array((3,), form).dtype == "float32", form
    with pytest.raises(ValueError, match="big-endian"):
        ctx.device_array((3,), np.dtype(">f4"))


def test_exceptions_are_named_as_the_package_names_them(ctx):
    assert emm.EmmError.__name__ == "EmmError" and emm.EmmError.__module__ == "emm"
    assert emm.OutOfMemoryError.__name__ == "OutOfMemoryError"
    assert issubclass(emm.EmmError, RuntimeError) and issubclass(emm.OutOfMemoryError, MemoryError)
    buf = ctx.memalloc(64)
    buf.release()
    with pytest.raises(emm.EmmError) as e:
        ctx.copy_to_host(buf)
    assert type(e.value).__qualname__ == "EmmError" and "PyEmmError" not in repr(e.value)


def test_the_type_stub_matches_the_extension():
    """``emm/_emm.pyi`` (editors' completion and documentation) is generated from the module;
    a change to the extension's Python surface regenerates it (``python stubgen.py``)."""
    stubgen = os.path.join(os.path.dirname(__file__), "..", "stubgen.py")
    out = subprocess.run([sys.executable, stubgen, "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_log_keeps_every_line_when_the_interpreter_exits(tmp_path):
    """The process's runtime lives until the interpreter exits and is never dropped: the
    package writes out what the log adaptor buffered at exit, so the last lines are kept (a
    log cut short would replay with its last frees missing)."""
    log = tmp_path / "run.csv"
    code = (
        "import emm\n"
        "ctx = emm.context(0)\n"
        "bufs = [ctx.memalloc_on(1000 * (k + 1), 0) for k in range(5)]\n"
        "del bufs\n"
        "b = ctx.memalloc(100)\n"
        "del b\n"
    )
    out = run_python(code, EMM_MEMORY_MANAGER="pool", EMM_MEMORY_ADAPTORS=f"log={log}")
    assert out.returncode == 0, out.stderr
    lines = log.read_text().splitlines()
    assert lines[0].endswith(",Kind,Reached"), lines[0]
    assert len(lines) == 1 + 12, lines
    assert [l.split(",")[2] for l in lines[1:]].count("free") == 6, lines
    # Stream-ordered memory says how far the GPU had got; memory without a stream says '-'.
    assert lines[1].split(",")[-1] != "-" and lines[-1].split(",")[-1] == "-", lines


@pytest.mark.parametrize("n", [1 << 62, (1 << 63) - 1, 4097])
def test_a_size_past_the_memory_is_refused_before_anything_is_allocated(ctx, n):
    """``copy_to_host`` and ``HostBuffer.read`` ask for at most what the memory holds: a larger
    ``n`` raises ``ValueError`` and leaves the interpreter alive (a size the host cannot
    allocate used to end the process)."""
    buf = ctx.memalloc(4096)
    host = ctx.memhostalloc(4096)
    with pytest.raises(ValueError, match="holds 4096 bytes"):
        ctx.copy_to_host(buf, n)
    with pytest.raises(ValueError, match="holds 4096 bytes"):
        host.read(n)
    with pytest.raises(ValueError, match="at most 96 bytes"):
        host.read(100, offset=4000)
    with pytest.raises(ValueError):
        ctx.copy_to_host(buf, 1, offset=5000)
    assert len(ctx.copy_to_host(buf, 96, offset=4000)) == 96
    assert len(host.read(96, offset=4000)) == 96


def test_tag_names_are_bounded():
    """Tag names live as long as the process, so their number is bounded: past 4096 distinct
    names ``emm.tag`` raises ``ValueError`` with advice, and the names already made still
    work (in a fresh interpreter: the names are process-wide)."""
    code = (
        "import emm\n"
        "made = 0\n"
        "try:\n"
        "    for i in range(5000):\n"
        "        emm.tag(f'step-{i}')\n"
        "        made += 1\n"
        "    raise SystemExit('no limit')\n"
        "except ValueError as e:\n"
        "    assert 'tag names' in str(e) and 'not each step' in str(e), e\n"
        "assert 4000 < made < 4096, made\n"
        "with emm.tag('step-0') as t:\n"
        "    assert t.name == 'step-0'\n"
        "print('ok')\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok", out.stdout


HOSTILE_SCRIPT = r"""
import itertools, math, sys
import emm

ctx = emm.context(0)
ALLOWED = (emm.EmmError, emm.OutOfMemoryError, ValueError, TypeError, OverflowError)


class BadStream:
    def __init__(self, answer):
        self.answer = answer

    def __cuda_stream__(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


INTS = [-1, 0, 1, 7, 2**31, 2**48, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
OTHERS = [None, 1.5, math.nan, "8", b"\0" * 7, object(), [1, 2], {"a": 1}]
STREAMS = [BadStream(a) for a in [(0, 12345), (0, 2**64 - 8), (0, -1), (1,), (0,), None,
                                   "junk", (0, 7), (0, "x"), ValueError("no stream")]]
VALUES = INTS + OTHERS + STREAMS

buf = ctx.memalloc(4096)
host = ctx.memhostalloc(4096)
mr = ctx.device_memory_resource()

calls = {
    "memalloc(size)": lambda v: ctx.memalloc(v),
    "memalloc_on(size, 0)": lambda v: ctx.memalloc_on(v, 0),
    "memalloc_on(64, stream)": lambda v: ctx.memalloc_on(64, v),
    "memhostalloc(size)": lambda v: ctx.memhostalloc(v),
    "memhostalloc(64, mapped=v)": lambda v: ctx.memhostalloc(64, mapped=v),
    "memallocmanaged(size)": lambda v: ctx.memallocmanaged(v),
    "mempin(bytearray, ptr, 64)": lambda v: ctx.mempin(bytearray(64), v, 64),
    "mempin(bytearray, None, size)": lambda v: ctx.mempin(bytearray(64), None, v),
    "mempin(owner, None, 8)": lambda v: ctx.mempin(v, None, 8),
    "copy_to_device(buf, data)": lambda v: ctx.copy_to_device(buf, v),
    "copy_to_device(buf, b, offset)": lambda v: ctx.copy_to_device(buf, b"x" * 8, v),
    "copy_to_host(buf, n)": lambda v: ctx.copy_to_host(buf, v),
    "copy_to_host(buf, 8, offset)": lambda v: ctx.copy_to_host(buf, 8, v),
    "copy_to_host(obj)": lambda v: ctx.copy_to_host(v),
    "get_ipc_handle(buf, offset)": lambda v: ctx.get_ipc_handle(buf, v),
    "get_ipc_handle(buf, 0, size)": lambda v: ctx.get_ipc_handle(buf, 0, v),
    "open_ipc(data)": lambda v: ctx.open_ipc(v),
    "device_array(shape, u8)": lambda v: ctx.device_array(v, "uint8"),
    "device_array((v, v), f4)": lambda v: ctx.device_array((v, v), "float32"),
    "device_array(4, dtype)": lambda v: ctx.device_array(4, v),
    "from_dlpack(obj)": lambda v: ctx.from_dlpack(v),
    "host.write(b, offset)": lambda v: host.write(b"y" * 8, v),
    "host.write(data)": lambda v: host.write(v),
    "host.read(n)": lambda v: host.read(v),
    "host.read(8, offset)": lambda v: host.read(8, v),
    "resource.allocate(size, 0)": lambda v: mr.allocate(v, 0),
    "resource.allocate(64, stream)": lambda v: mr.allocate(64, v),
    "resource.deallocate(obj, 0)": lambda v: mr.deallocate(v, 0),
    "tag(name)": lambda v: emm.tag(v).__enter__(),
    "on_out_of_memory(callback)": lambda v: ctx.on_out_of_memory(v),
}
typed = 0
for (name, call), value in itertools.product(calls.items(), VALUES):
    print(f"{name} with {value!r:.60}", flush=True)
    try:
        result = call(value)
    except ALLOWED:
        typed += 1
        continue
    except BaseException as e:
        print(f"UNTYPED {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    # What was accepted is released again, so that the next call has room.
    for attr in ("release", "close"):
        getattr(result, attr, lambda: None)()
ctx.on_out_of_memory(None)
# A callback that cannot be called is refused when it is set, not at the out-of-memory.
try:
    ctx.on_out_of_memory(5)
    sys.exit("a non-callable callback was taken")
except TypeError as e:
    assert "callable" in str(e), e
# The interpreter and the context still work.
ctx.copy_to_device(buf, b"z" * 16)
assert ctx.copy_to_host(buf, 16) == b"z" * 16
print(f"ok {len(calls) * len(VALUES)} calls, {typed} refused with a typed error")
"""


def test_hostile_values_raise_typed_errors_and_the_interpreter_lives():
    # Every entry point above, each argument given every value of the table (ints from -1 to
    # past 2**64, other types, stream objects whose protocol lies or raises): each call works
    # or raises emm.EmmError, emm.OutOfMemoryError, ValueError, TypeError or OverflowError (Python's own for an int
    # that does not fit), and nothing aborts or corrupts the interpreter, which must still
    # copy memory at the end. In a subprocess: an abort shows as its exit status, and the
    # last line printed names the call.
    if DRIVER == "cuda":
        pytest.skip(
            "allocates up to the simulated device's limits with forged values; the GPU runs "
            "the typed refusals' own tests"
        )
    out = run_python(HOSTILE_SCRIPT, EMM_SIM_DEVICE_MEMORY=str(256 << 20))
    last = out.stdout.strip().splitlines()[-1:] or ["(nothing printed)"]
    assert out.returncode == 0 and last[0].startswith("ok "), (
        f"exit {out.returncode} at: {last[0]}\n{out.stderr[-3000:]}"
    )


def test_device_report_lists_the_emm_processes_of_a_device(tmp_path, monkeypatch):
    # Two processes hold 8 and 24 MiB; each writes its figures to the ledger every 0.1 s, and
    # this process's report lists both, the larger first, and itself. A process that ended is
    # dropped from the next report (its record removed). On the simulator each process has a
    # device of its own with the same identity, which is what the ledger keys on.
    monkeypatch.setenv("EMM_LEDGER_DIR", str(tmp_path))
    holder = (
        "import emm, sys\n"
        "ctx = emm.context(0)\n"
        "b = ctx.memalloc(int(sys.argv[1]))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {
        **os.environ,
        "EMM_PYTHON_DRIVER": DRIVER,
        "EMM_MEMORY_MANAGER": "pool",
        "EMM_MEMORY_ADAPTORS": "stats",
        "EMM_LEDGER_SECONDS": "0.1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", holder, str(n << 20)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in (8, 24)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        pids = [p.pid for p in procs]
        deadline = time.monotonic() + 20
        while True:
            rows = {r["pid"]: r for r in emm.device_report(0)}
            if all(rows.get(pid, {}).get("live_bytes") == n << 20 for pid, n in zip(pids, (8, 24))):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.1)
        order = [r["pid"] for r in emm.device_report(0)]
        assert order.index(pids[1]) < order.index(pids[0]), "the larger holder first"
        assert os.getpid() in rows, "this process reports itself"
        assert rows[pids[0]]["manager"] == "stats(pool)", rows[pids[0]]
        assert rows[pids[0]]["held_bytes"] >= 8 << 20, rows[pids[0]]
        procs[0].stdin.close()
        procs[0].wait(timeout=20)
        device_dir = tmp_path / os.listdir(tmp_path)[0]
        assert not (device_dir / f"{pids[0]}.json").exists(), "removed at its exit"
        assert pids[0] not in {r["pid"] for r in emm.device_report(0)}
        # A process killed without its exit handlers leaves its record; the next report
        # finds it ended and removes it.
        procs[1].kill()
        procs[1].wait(timeout=20)
        assert (device_dir / f"{pids[1]}.json").exists()
        assert pids[1] not in {r["pid"] for r in emm.device_report(0)}
        assert not (device_dir / f"{pids[1]}.json").exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()
