"""RMM's random workload through emm: allocations of uniformly random sizes from 1 byte to a
maximum (64 MiB here), each step allocating with probability 0.73 and otherwise freeing a
random live block, under a cap on live bytes (16 000 MiB), on the legacy default stream."""

import common

p = common.parser(__doc__, steps=10000)
p.add_argument("--max-mib", type=int, default=64)
p.add_argument("--cap-mib", type=int, default=16000)
args = p.parse_args()
if args.device == "cpu":
    common.fail("the random workload allocates through emm, which needs the GPU driver here")
import emm  # noqa: E402

ctx = emm.context(0)
r = common.rng(args.seed)
cap, top = args.cap_mib << 20, args.max_mib << 20
live, bytes_live, peak, allocations = [], 0, 0, 0
timer = common.Timer(warmup=0)
timer.begin()
while allocations < args.steps:
    size = r.randrange(top) + 1
    if (r.random() < 0.73 or not live) and bytes_live + size <= cap:
        live.append(ctx.memalloc_on(size, 0))
        bytes_live += size
        peak = max(peak, bytes_live)
        allocations += 1
    elif live:
        k = r.randrange(len(live))
        live[k], live[-1] = live[-1], live[k]
        bytes_live -= live.pop().size
del live
timer.end()
common.report(
    workload="rmm_random",
    allocations=allocations,
    peak_live=peak,
    total_s=timer.total_s(),
    memory=common.emm_figures(),
)
