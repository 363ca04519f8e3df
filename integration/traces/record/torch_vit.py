"""A vision transformer trained in mixed precision: patches of 16 pixels, 8 blocks of d=384
and 6 heads, images of 160-256 pixels and micro-batches of 8-48 drawn per step; bf16
autocast, each block's activations recomputed in the backward pass (activation
checkpointing), and four micro-batches accumulated per optimiser step (AdamW)."""

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import common

ACCUMULATE = 4
args = common.parser(__doc__, steps=60).parse_args()
common.install("torch", args)
dev = torch.device(args.device)
cuda = args.device == "cuda"
torch.manual_seed(args.seed)
shapes = common.rng(args.seed)
D, HEADS, BLOCKS, PATCH, CLASSES = (384, 6, 8, 16, 100) if cuda else (64, 4, 2, 16, 10)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.n2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, D, PATCH, PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x[:, 0]))


model = ViT().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
losses, timer = [], common.Timer()
counts = common.Counters(torch, args)
for step in range(args.steps):
    if step == common.warmup_steps(args.steps):
        counts.warmed()
    px = shapes.choice([160, 192, 224, 256]) if cuda else 32
    timer.begin()
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for _ in range(ACCUMULATE):
        b = shapes.randint(8, 48) if cuda else 2
        x = torch.randn(b, 3, px, px, device=dev)
        y = torch.randint(0, CLASSES, (b,), device=dev)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y) / ACCUMULATE
        loss.backward()
        total += loss.item()
    opt.step()
    losses.append(total)
    timer.end()
common.finish(
    "torch_vit", args, timer, common.torch_figures(torch, args), losses=losses, **counts.fields()
)
