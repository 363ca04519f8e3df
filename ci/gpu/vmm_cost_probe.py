"""What releasing and mapping again 40 GiB of VMM memory costs, call by call, for vmm-pool's
sleep and wake: cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease per piece,
for several piece sizes, whether one cuMemUnmap may span several mappings, and what releasing
each handle right after mapping it (so that the unmap frees the memory) saves. Prints one CSV
line per measurement: what,piece_bytes,pieces,seconds,us_per_call, and the same calls from 1, 4
and 8 threads last. `python/bench/vmm_costs.py` times each call over fewer pieces, for a
growth's costs; this one times a whole 40 GiB sleep's.

    timeout 300 python3 ci/gpu/vmm_cost_probe.py [TOTAL_BYTES]"""
import sys
import time

from cuda.bindings import driver as cu

TOTAL = int(sys.argv[1]) if len(sys.argv) > 1 else 40 << 30


def ok(res):
    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    return res[1] if isinstance(res, tuple) and len(res) == 2 else None


ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
desc = cu.CUmemAccessDesc()
desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
desc.location.id = 0
desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
base = int(ok(cu.cuMemAddressReserve(TOTAL, 2 << 20, 0, 0)))


def line(what, piece, n, secs):
    print(f"{what},{piece},{n},{secs:.6f},{secs / max(n, 1) * 1e6:.2f}", flush=True)


def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def make_and_map(piece):
    n = TOTAL // piece
    handles = []
    line("create", piece, n, timed(lambda: handles.extend(ok(cu.cuMemCreate(piece, prop, 0)) for _ in range(n))))
    line("map", piece, n, timed(lambda: [ok(cu.cuMemMap(base + i * piece, piece, 0, h, 0)) for i, h in enumerate(handles)]))
    line("set_access_once", piece, 1, timed(lambda: ok(cu.cuMemSetAccess(base, TOTAL, [desc], 1))))
    ok(cu.cuCtxSynchronize())
    return handles


for piece in [2 << 20, 32 << 20, 512 << 20]:
    n = TOTAL // piece
    # Unmap each piece, then release each handle.
    hs = make_and_map(piece)
    line("unmap", piece, n, timed(lambda: [ok(cu.cuMemUnmap(base + i * piece, piece)) for i in range(n)]))
    line("release_unmapped", piece, n, timed(lambda: [ok(cu.cuMemRelease(h)) for h in hs]))
    # Release each handle while mapped, then unmap: the unmap frees the memory.
    hs = make_and_map(piece)
    line("release_mapped", piece, n, timed(lambda: [ok(cu.cuMemRelease(h)) for h in hs]))
    line("unmap_frees", piece, n, timed(lambda: [ok(cu.cuMemUnmap(base + i * piece, piece)) for i in range(n)]))

# One cuMemUnmap over many mappings side by side.
piece = 2 << 20
hs = make_and_map(piece)
for h in hs:
    ok(cu.cuMemRelease(h))
t = time.perf_counter()
err = cu.cuMemUnmap(base, TOTAL)[0]
secs = time.perf_counter() - t
print(f"# one cuMemUnmap over {TOTAL // piece} mappings: {err}", flush=True)
if err == cu.CUresult.CUDA_SUCCESS:
    line("unmap_span_frees", piece, 1, secs)
else:
    line("unmap_frees", piece, len(hs), timed(lambda: [ok(cu.cuMemUnmap(base + i * piece, piece)) for i in range(len(hs))]))
print(f"# free after: {cu.cuMemGetInfo()[1]} bytes", flush=True)
ok(cu.cuMemAddressFree(base, TOTAL))

# The same calls from several threads at once, each on its own slice (2 MiB pieces): whether
# the driver runs them side by side. cuda.bindings releases the GIL around each driver call.
import threading


def threaded(what, threads, work):
    n = TOTAL // (2 << 20)
    per = n // threads
    def run(k):
        ok(cu.cuCtxSetCurrent(ctx))
        work(k * per, (k + 1) * per)
    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    line(f"{what}_threads{threads}", 2 << 20, n, time.perf_counter() - t)


base = int(ok(cu.cuMemAddressReserve(TOTAL, 2 << 20, 0, 0)))
P = 2 << 20
handles = [None] * (TOTAL // P)
for threads in [1, 4, 8]:
    def create_map(a, b):
        for i in range(a, b):
            handles[i] = ok(cu.cuMemCreate(P, prop, 0))
            ok(cu.cuMemMap(base + i * P, P, 0, handles[i], 0))
    def access(a, b):
        ok(cu.cuMemSetAccess(base + a * P, (b - a) * P, [desc], 1))
    def unmap(a, b):
        for i in range(a, b):
            ok(cu.cuMemUnmap(base + i * P, P))
    def release(a, b):
        for i in range(a, b):
            ok(cu.cuMemRelease(handles[i]))
    threaded("create_map", threads, create_map)
    threaded("set_access", threads, access)
    threaded("unmap", threads, unmap)
    threaded("release", threads, release)
ok(cu.cuMemAddressFree(base, TOTAL))
