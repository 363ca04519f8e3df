"""A PyTorch CNN trained on images whose batch and resolution change every step: a small
ResNet (four stages of residual blocks with batch norm), batch 8-64 and square images of
64-224 pixels drawn per step, SGD with momentum, fixed seeds."""

import torch
import torch.nn as nn

import common

args = common.parser(__doc__, steps=200).parse_args()
common.install("torch", args)
dev = torch.device(args.device)
torch.manual_seed(args.seed)
shapes = common.rng(args.seed)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.a = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.b = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.a(x)))
        return torch.relu(self.bn2(self.b(y)) + self.skip(x))


def stage(cin, cout, stride):
    return nn.Sequential(Block(cin, cout, stride), Block(cout, cout, 1))


model = nn.Sequential(
    nn.Conv2d(3, 64, 7, 2, 3, bias=False),
    nn.BatchNorm2d(64),
    nn.ReLU(),
    nn.MaxPool2d(3, 2, 1),
    stage(64, 64, 1),
    stage(64, 128, 2),
    stage(128, 256, 2),
    stage(256, 512, 2),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(512, 100),
).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
losses, timer = [], common.Timer()
counts = common.Counters(torch, args)
for step in range(args.steps):
    if step == common.warmup_steps(args.steps):
        counts.warmed()
    b, px = shapes.randint(8, 64), shapes.choice([64, 96, 128, 160, 192, 224])
    if args.device == "cpu":
        b, px = 2, 32
    timer.begin()
    x = torch.randn(b, 3, px, px, device=dev)
    y = torch.randint(0, 100, (b,), device=dev)
    loss = nn.functional.cross_entropy(model(x), y)
    common.train(opt, loss, losses)
    timer.end()
common.finish(
    "torch_cnn", args, timer, common.torch_figures(torch, args), losses=losses,
    **counts.fields(),
)
