"""Times the peers emm is compared with, on the GPU machine, in the format of bench_gpu
(section,subject,param,threads,value,unit): the PyTorch caching allocator (torch.empty) and
CuPy's memory pool (cupy.cuda.alloc), alloc + free pairs, median of 5 batches.
Run by ci/gpu/bench-gpu.sh right after bench_gpu, on the same GPU."""
import statistics
import sys
import time

SIZES = [256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]


def per_op(fn, iters):
    for _ in range(max(iters // 10, 1)):
        fn()
    samples = []
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter_ns() - t) / iters)
    return statistics.median(samples)


def report(subject, make):
    for size in SIZES:
        ns = per_op(lambda: make(size), 20000)
        print(f"pair,{subject},{size},1,{ns:.3f},ns", flush=True)


try:
    import torch

    torch.empty(1, device="cuda")
    report("pytorch", lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"))
    torch.cuda.empty_cache()
except Exception as e:  # a missing peer is reported, not fatal
    print(f"bench_peers: PyTorch not measured: {e}", file=sys.stderr)

try:
    import cupy

    cupy.cuda.alloc(1)
    report("cupy", lambda n: cupy.cuda.alloc(n))
    cupy.get_default_memory_pool().free_all_blocks()
except Exception as e:
    print(f"bench_peers: CuPy not measured: {e}", file=sys.stderr)
