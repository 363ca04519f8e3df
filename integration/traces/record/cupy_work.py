"""CuPy array work over sizes that change every step: 1-D and 2-D FFTs, matrix products,
a linear solve and a QR factorisation, sorting and argsort, cumulative sums and reductions,
with n from 10^5 to 3*10^7 elements and matrices from 256 to 4096 wide, drawn per step."""

import common

args = common.parser(__doc__, steps=200).parse_args()
if args.device == "cpu":
    import numpy as xp
else:
    import cupy as xp

    common.install("cupy", args)
shapes = common.rng(args.seed)
gen = xp.random.default_rng(args.seed) if args.device == "cuda" else xp.random.default_rng(args.seed)
checksum, timer = 0.0, common.Timer()
for step in range(args.steps):
    n = int(10 ** shapes.uniform(5, 7.5))
    m = shapes.choice([256, 512, 768, 1024, 1536, 2048, 3072, 4096])
    if args.device == "cpu":
        n, m = n // 1000, m // 16
    timer.begin()
    a = gen.standard_normal(n, dtype=xp.float32)
    f = xp.fft.rfft(a)
    back = xp.fft.irfft(f, n)
    s = xp.sort(a)
    order = xp.argsort(back)
    c = xp.cumsum(s)
    x = gen.standard_normal((m, m), dtype=xp.float32)
    y = x @ x.T + m * xp.eye(m, dtype=xp.float32)
    z = xp.linalg.solve(y, x[:, :16])
    q, r = xp.linalg.qr(x[:, : m // 2])
    f2 = xp.fft.fft2(x)
    checksum += float(
        c[-1] + z.sum() + xp.abs(f2).max() + r[0, 0] + order[0] + xp.abs(q).sum()
    )
    del a, f, back, s, order, c, x, y, z, q, r, f2
    timer.end()
figures = {}
if args.device == "cuda":
    xp.cuda.Device().synchronize()
    pool = xp.get_default_memory_pool()
    figures = (
        {"used_bytes": pool.used_bytes(), "total_bytes": pool.total_bytes()}
        if args.allocator == "native"
        else common.emm_figures()
    )
common.finish("cupy_work", args, timer, figures, checksum=checksum)
