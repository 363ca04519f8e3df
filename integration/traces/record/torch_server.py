"""An inference server: four threads, each with a CUDA stream of its own, serve requests of
varying size drawn per request (batch 1-48, sequence 16-384) through one shared 6-layer
transformer encoder (d=768, fp16, no gradients). Each request's input is made in page-locked
host memory, copied to the device on the thread's stream without blocking, and its output
copied back into page-locked memory before the thread waits for its stream. ``--steps`` is
the requests per thread; the result is each thread's outputs' checksum."""

import threading

import torch
import torch.nn as nn

import common

THREADS = 4
args = common.parser(__doc__, steps=150).parse_args()
common.install("torch", args)
dev = torch.device(args.device)
torch.manual_seed(args.seed)
D, LAYERS = (768, 6) if args.device == "cuda" else (64, 2)
dtype = torch.float16 if args.device == "cuda" else torch.float32
layer = nn.TransformerEncoderLayer(
    d_model=D, nhead=12 if D == 768 else 4, dim_feedforward=4 * D, dropout=0.0, batch_first=True
)
model = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
model = model.to(dev, dtype).eval()
cuda = args.device == "cuda"
timer = common.Timer(warmup=THREADS * 5)
counts = common.Counters(torch, args)
sums = [0.0] * THREADS
failures = []
start = threading.Barrier(THREADS)
lock = threading.Lock()
served = [0]
# The checksum weighs each output feature differently, so that a wrong row shows.
weights = torch.arange(1, 17, dtype=torch.float64)


def serve(k):
    shapes = common.rng(args.seed * 100 + k)
    stream = torch.cuda.Stream() if cuda else None
    gen = torch.Generator().manual_seed(args.seed * 100 + k)
    start.wait()
    for _ in range(args.steps):
        b, s = shapes.randint(1, 48), shapes.randint(16, 384)
        if not cuda:
            b, s = max(1, b // 8), max(4, s // 32)
        t = common.Timer()
        t.begin()
        host = torch.randn(b, s, D, generator=gen).to(dtype)
        if cuda:
            host = host.pin_memory()
        out = torch.empty(b, 16, dtype=torch.float32, pin_memory=cuda)
        with torch.inference_mode():
            if cuda:
                with torch.cuda.stream(stream):
                    x = host.to(dev, non_blocking=True)
                    y = model(x)[:, 0, :16].float()
                    out.copy_(y, non_blocking=True)
                    del x, y
                stream.synchronize()
            else:
                out.copy_(model(host)[:, 0, :16].float())
        t.end()
        with lock:
            timer.times.append(t.times[0])
            served[0] += 1
            if served[0] == common.warmup_steps(args.steps) * THREADS:
                counts.warmed()
        sums[k] += float((out.double() * weights).sum())


def run(k):
    try:
        serve(k)
    except BaseException as e:  # reported in the result line, not lost in a thread
        failures.append(f"thread {k}: {e!r}")


threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if failures:
    common.fail("; ".join(failures))
common.finish(
    "torch_server", args, timer, common.torch_figures(torch, args),
    checksums=[round(s, 3) for s in sums], **counts.fields(),
)
