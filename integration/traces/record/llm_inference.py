"""An LLM-style inference loop: a decoder-only transformer (8 layers, d=1024, 16 heads, a
32 000-token vocabulary) serving requests of 1-16 prompts of 32-512 tokens each, drawn per
request; each request runs a prefill and then generates 32-128 tokens greedily, growing its
key-value cache by one position a token (concatenation, as simple servers do). No gradients."""

import torch
import torch.nn as nn

import common

args = common.parser(__doc__, steps=40).parse_args()
common.install("torch", args)
dev = torch.device(args.device)
torch.manual_seed(args.seed)
shapes = common.rng(args.seed)
D, H, L, V = 1024, 16, 8, 32000
if args.device == "cpu":
    D, H, L, V = 64, 4, 2, 500
dtype = torch.float16 if args.device == "cuda" else torch.float32


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.up = nn.Linear(D, 4 * D, bias=False)
        self.down = nn.Linear(4 * D, D, bias=False)
        self.n1 = nn.LayerNorm(D)
        self.n2 = nn.LayerNorm(D)

    def forward(self, x, cache):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split(D, dim=-1)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        causal = cache is None
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, D))
        x = x + self.down(nn.functional.gelu(self.up(self.n2(x))))
        return x, (k, v)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Layer() for _ in range(L))
        self.norm = nn.LayerNorm(D)
        self.lm = nn.Linear(D, V, bias=False)

    def forward(self, ids, caches):
        x = self.emb(ids)
        new = []
        for layer, cache in zip(self.layers, caches):
            x, c = layer(x, cache)
            new.append(c)
        return self.lm(self.norm(x[:, -1:])), new


model = Model().to(dev, dtype).eval()
tokens, checksum, timer = 0, 0, common.Timer(warmup=2)
with torch.no_grad():
    for request in range(args.steps):
        b, prompt, gen = shapes.randint(1, 16), shapes.randint(32, 512), shapes.randint(32, 128)
        if args.device == "cpu":
            prompt, gen = prompt // 16, 4
        timer.begin()
        ids = torch.randint(0, V, (b, prompt), device=dev)
        logits, caches = model(ids, [None] * L)
        out = []
        for _ in range(gen):
            nxt = logits.argmax(-1)
            out.append(nxt)
            logits, caches = model(nxt, caches)
        generated = torch.cat(out, dim=1)
        checksum = (checksum + int(generated.sum().item())) % (1 << 61)
        tokens += b * gen
        del caches, logits, generated, out
        timer.end()
common.finish(
    "llm_inference",
    args,
    timer,
    common.torch_figures(torch, args),
    tokens=tokens,
    checksum=checksum,
)
