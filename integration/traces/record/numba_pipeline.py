"""A Numba CUDA kernel pipeline over sizes that change every step: host data to the device,
a chain of kernels (scale and shift, a three-point stencil, a block-wise partial sum) with
device temporaries of the step's size, a reduction on the device, and results back. n from
10^4 to 2*10^7 elements per step. Under emm, NUMBA_CUDA_MEMORY_MANAGER=emm.numba (set by the
caller)."""

import math

import numpy as np

import common

args = common.parser(__doc__, steps=200).parse_args()
if args.device == "cpu":
    common.fail("the Numba pipeline needs a GPU (its kernels are CUDA kernels)")
from numba import cuda  # noqa: E402


@cuda.jit
def scale(a, out, s, t):
    i = cuda.grid(1)
    if i < a.size:
        out[i] = a[i] * s + t


@cuda.jit
def stencil(a, out):
    i = cuda.grid(1)
    if 0 < i < a.size - 1:
        out[i] = 0.25 * a[i - 1] + 0.5 * a[i] + 0.25 * a[i + 1]
    elif i < a.size:
        out[i] = a[i]


@cuda.jit
def partial_sums(a, out):
    shared = cuda.shared.array(256, dtype=np.float32)
    i = cuda.grid(1)
    t = cuda.threadIdx.x
    shared[t] = a[i] if i < a.size else 0.0
    cuda.syncthreads()
    step = 128
    while step > 0:
        if t < step:
            shared[t] += shared[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = shared[0]


shapes = common.rng(args.seed)
data = np.random.default_rng(args.seed)
checksum, timer = 0.0, common.Timer()
stream = cuda.default_stream()
for step in range(args.steps):
    n = int(10 ** shapes.uniform(4, 7.3))
    blocks = math.ceil(n / 256)
    timer.begin()
    host = data.standard_normal(n).astype(np.float32)
    a = cuda.to_device(host, stream=stream)
    b = cuda.device_array(n, dtype=np.float32, stream=stream)
    c = cuda.device_array(n, dtype=np.float32, stream=stream)
    sums = cuda.device_array(blocks, dtype=np.float32, stream=stream)
    scale[blocks, 256, stream](a, b, 1.5, 0.25)
    stencil[blocks, 256, stream](b, c)
    partial_sums[blocks, 256, stream](c, sums)
    total = sums.copy_to_host(stream=stream).sum(dtype=np.float64)
    back = c.copy_to_host(stream=stream)
    stream.synchronize()
    checksum += float(total) + float(back[n // 2])
    del a, b, c, sums
    timer.end()
if args.allocator == "emm":
    figures = common.emm_figures()
else:
    free, total = cuda.current_context().get_memory_info()
    figures = {"free": free, "total": total}
common.finish("numba_pipeline", args, timer, figures, checksum=checksum)
