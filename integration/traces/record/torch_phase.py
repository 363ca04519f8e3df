"""A phase change: a large model is trained (a 6-layer transformer encoder, d=1024, batch
8-32 and sequence 256-512 drawn per step), then deleted with its optimiser, the cache emptied
(``torch.cuda.empty_cache()``), and a small model serves requests (2 layers, d=256, batch 1-8
and sequence 32-128 drawn per request, no gradients). ``--steps`` counts the training steps;
the serving phase runs four times as many requests. The result line says what the allocator
held after the emptying and at most while serving."""

import torch
import torch.nn as nn

import common

args = common.parser(__doc__, steps=60).parse_args()
common.install("torch", args)
dev = torch.device(args.device)
cuda = args.device == "cuda"
torch.manual_seed(args.seed)
shapes = common.rng(args.seed)


def encoder(d, layers):
    layer = nn.TransformerEncoderLayer(
        d_model=d, nhead=8, dim_feedforward=4 * d, dropout=0.0, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).to(dev)


def held():
    return common.counters(torch, args).get("held_bytes", 0)


D = 1024 if cuda else 64
model, head = encoder(D, 6 if cuda else 1), nn.Linear(D, 1000).to(dev)
params = list(model.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=1e-4)
losses, timer = [], common.Timer()
counts = common.Counters(torch, args)
for step in range(args.steps):
    if step == common.warmup_steps(args.steps):
        counts.warmed()
    b, s = shapes.randint(8, 32), shapes.randint(256, 512)
    if not cuda:
        b, s = 2, 16
    timer.begin()
    x = torch.randn(b, s, D, device=dev)
    y = torch.randint(0, 1000, (b, s), device=dev)
    loss = nn.functional.cross_entropy(head(model(x)).reshape(-1, 1000), y.reshape(-1))
    common.train(opt, loss, losses)
    timer.end()
training = common.counters(torch, args)
del model, head, params, opt, x, y, loss
if cuda:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
after_empty = held()
small = encoder(256 if cuda else 32, 2).eval()
serve_timer, serving_held, checksum = common.Timer(), 0, 0.0
with torch.inference_mode():
    for _ in range(4 * args.steps):
        b, s = shapes.randint(1, 8), shapes.randint(32, 128)
        serve_timer.begin()
        out = small(torch.randn(b, s, 256 if cuda else 32, device=dev)).square().sum()
        checksum += float(out)
        serve_timer.end()
        serving_held = max(serving_held, held())
common.finish(
    "torch_phase", args, timer, common.torch_figures(torch, args), losses=losses,
    checksum=round(checksum, 2), training=training, held_after_empty_cache=after_empty,
    serving_peak_held=serving_held, serving_ms_median=serve_timer.median_ms(), **counts.fields(),
)
