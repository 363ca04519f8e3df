"""A PyTorch training loop whose shapes change every step: a 4-layer transformer encoder
(d=512, 8 heads), batch 4-32 and sequence 64-512 drawn per step, AdamW, fixed seeds."""

import torch
import torch.nn as nn

import common

args = common.parser(__doc__, steps=300).parse_args()
common.install("torch", args)
dev = torch.device(args.device)
torch.manual_seed(args.seed)
shapes = common.rng(args.seed)
layer = nn.TransformerEncoderLayer(
    d_model=512, nhead=8, dim_feedforward=2048, dropout=0.1, batch_first=True
)
model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).to(dev)
head = nn.Linear(512, 1000).to(dev)
params = list(model.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=1e-4)
losses, timer = [], common.Timer()
use = common.DeviceUse(torch, args)
counts = common.Counters(torch, args)
for step in range(args.steps):
    if step == common.warmup_steps(args.steps):
        counts.warmed()
    b, s = shapes.randint(4, 32), shapes.randint(64, 512)
    if args.device == "cpu":
        b, s = max(1, b // 8), max(8, s // 16)
    timer.begin()
    x = torch.randn(b, s, 512, device=dev)
    y = torch.randint(0, 1000, (b, s), device=dev)
    loss = nn.functional.cross_entropy(head(model(x)).reshape(-1, 1000), y.reshape(-1))
    common.train(opt, loss, losses)
    timer.end()
    use.read()
common.finish(
    "torch_transformer", args, timer, common.torch_figures(torch, args, use), losses=losses,
    **counts.fields(),
)
