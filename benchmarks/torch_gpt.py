"""The PyTorch peer of benchmarks/train_step.py's GPT, layer for layer.

Same shapes and FLOPs as the Flax model: learned token and position
embeddings; pre-LayerNorm blocks; attention with separate biased q/k/v/out
projections, materialised scores, a causal mask and an fp32 softmax (not
flash attention, which would do different work); a 4x tanh-GELU MLP; a final
LayerNorm and an unbiased vocabulary projection. With ``sdpa=True`` the
attention is torch's ``scaled_dot_product_attention`` (flash attention on a
GPU): the peer of jmp_lab's lean step, whose attention is fused too. Only
imported on a CUDA machine with torch.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
  def __init__(self, width: int, heads: int, sdpa: bool = False):
    super().__init__()
    self.heads, self.sdpa = heads, sdpa
    self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

  def forward(self, x):
    b, t, d = x.shape
    split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
    q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
    if self.sdpa:
      out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      return self.out(out.transpose(1, 2).reshape(b, t, d))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores.float(), dim=-1).to(v.dtype)  # fp32 softmax
    return self.out((weights @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
  def __init__(self, width: int, heads: int, sdpa: bool = False):
    super().__init__()
    self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
    self.attn = Attention(width, heads, sdpa)
    self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

  def forward(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  def __init__(self, size, sdpa: bool = False):
    super().__init__()
    self.tokens = nn.Embedding(size.vocab, size.width)
    self.positions = nn.Embedding(size.seq_len, size.width)
    self.blocks = nn.ModuleList(Block(size.width, size.heads, sdpa)
                                for _ in range(size.layers))
    self.ln = nn.LayerNorm(size.width)
    self.head = nn.Linear(size.width, size.vocab, bias=False)

  def forward(self, tokens):
    x = self.tokens(tokens) + self.positions(
        torch.arange(tokens.shape[1], device=tokens.device))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))
