"""Times the driver's virtual memory calls on device 0, per call, for pieces of 2 MiB and more.

Run on the GPU machine (cuda-python's `cuda.bindings`): `python3 python/bench/vmm_costs.py`.
vmm-pool maps its memory in pieces of the granularity; these are what each piece costs.
"""
import time
from cuda.bindings import driver as d

def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    assert err == d.CUresult.CUDA_SUCCESS, err
    return r[1] if isinstance(r, tuple) and len(r) > 1 else None

ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(0))
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
ok(d.cuCtxSetCurrent(ctx))
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
gran = ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
acc = d.CUmemAccessDesc()
acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.location.id = 0
acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
base = ok(d.cuMemAddressReserve(64 << 30, 0, 0, 0))
print("granularity", gran)

def run(piece, count, rounds=5, prop_=prop):
    t = {k: 0.0 for k in ("create", "map", "access", "unmap", "release")}
    for _ in range(rounds):
        hs = []
        s = time.perf_counter()
        for i in range(count):
            hs.append(ok(d.cuMemCreate(piece, prop_, 0)))
        t["create"] += time.perf_counter() - s
        s = time.perf_counter()
        for i, h in enumerate(hs):
            ok(d.cuMemMap(int(base) + i * piece, piece, 0, h, 0))
        t["map"] += time.perf_counter() - s
        s = time.perf_counter()
        ok(d.cuMemSetAccess(int(base), piece * count, [acc], 1))
        t["access"] += time.perf_counter() - s
        s = time.perf_counter()
        for i in range(count):
            ok(d.cuMemUnmap(int(base) + i * piece, piece))
        t["unmap"] += time.perf_counter() - s
        s = time.perf_counter()
        for h in hs:
            ok(d.cuMemRelease(h))
        t["release"] += time.perf_counter() - s
    n = rounds * count
    per = {k: v / n * 1e6 for k, v in t.items()}
    per["access"] = t["access"] / rounds * 1e6
    total = sum(t.values()) / rounds * 1e6
    print(f"piece {piece >> 20:5d} MiB x {count:4d}: per call create {per['create']:7.1f} map {per['map']:6.1f} unmap {per['unmap']:6.1f} release {per['release']:7.1f} us; one setAccess over all {per['access']:8.1f} us; whole {total/1000:8.2f} ms for {piece*count>>20} MiB")

run(gran, 1, 20)
run(gran, 32)
run(gran, 512)
run(8 << 20, 128)
run(64 << 20, 1, 20)
run(64 << 20, 16)
run(1 << 30, 1, 10)
# remap only: keep the handles, unmap and map them again at another place
hs = [ok(d.cuMemCreate(gran, prop, 0)) for _ in range(256)]
for i, h in enumerate(hs):
    ok(d.cuMemMap(int(base) + i * gran, gran, 0, h, 0))
ok(d.cuMemSetAccess(int(base), gran * 256, [acc], 1))
s = time.perf_counter()
for i, h in enumerate(hs):
    ok(d.cuMemUnmap(int(base) + i * gran, gran))
    ok(d.cuMemMap(int(base) + (1 << 30) + i * gran, gran, 0, h, 0))
ok(d.cuMemSetAccess(int(base) + (1 << 30), gran * 256, [acc], 1))
e = time.perf_counter() - s
print(f"relocating 256 pieces of 2 MiB (unmap, map, one setAccess): {e/256*1e6:.1f} us a piece")
s = time.perf_counter()
for i in range(10000):
    p = ok(d.cuMemAlloc(2 << 20)); ok(d.cuMemFree(p))
print(f"cuMemAlloc+cuMemFree 2 MiB: {(time.perf_counter()-s)/10000*1e6:.1f} us")
