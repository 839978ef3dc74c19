"""The char transformer of ``examples/char_transformer.py`` in PyTorch,
trained with ``torch.optim.AdamW`` and torchao's ``AdamW8bit`` (and
``AdamWFp8``): the anchor the 8-bit moments of ``jmp_lab`` are measured
against (``benchmarks/lean_accuracy.py --eight-bit``).

Same architecture, data, batches, schedule, clipping and weight decay as the
example: byte tokens of the Python standard library's sources (95/5 split),
pre-LayerNorm blocks with 4-head causal attention and a 4x tanh-GELU MLP
(dropout 0.1 on its output), learned positions, an unbiased head; AdamW with
a 50-step linear warmup and a cosine decay, global-norm clipping at 1 and
weight decay 0.01 on every param; validation loss on the same 16 held-out
windows. The initial weights are PyTorch's, not Flax's, so compare each
framework's 8-bit run with its own fp32 moments. fp32 params and compute
(torchao's optimizers quantize the moments only).

Two steps, in two environments (jax's and torch's)::

  # the tokens and the validation windows, from the example itself
  PYTHONPATH=.:examples python benchmarks/torchao_char.py export /tmp/char.npz \\
      --seq-len 64
  # torch 2.13 (CPU) and torchao
  python benchmarks/torchao_char.py train /tmp/char.npz --steps 2000 \\
      --batch-size 8 --seq-len 64 --json benchmarks/torchao_char.json
  # MXFP8 training (torchao 0.18's MXTensor quantization), against bf16
  python benchmarks/torchao_char.py train /tmp/char.npz --steps 2000 \\
      --batch-size 8 --seq-len 64 --mxfp8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def export(path: str, seq_len: int) -> None:
  """Writes the example's train tokens and validation windows (needs jax)."""
  import char_transformer  # pylint: disable=import-outside-toplevel
  tokens = char_transformer.load_tokens(None)
  split = int(0.95 * len(tokens))
  np.savez(path, train=tokens[:split],
           valid=char_transformer.validation_batch(tokens[split:], seq_len))
  print(f"wrote {path}: {split:,} train tokens")


def build_model(seq_len: int, width: int = 128, depth: int = 2,
                heads: int = 4, vocab: int = 256, dropout: float = 0.1):
  import torch  # pylint: disable=import-outside-toplevel
  from torch import nn  # pylint: disable=import-outside-toplevel
  from torch.nn import functional as F  # pylint: disable=import-outside-toplevel

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln1 = nn.LayerNorm(width, eps=1e-6)
      self.ln2 = nn.LayerNorm(width, eps=1e-6)
      self.q, self.k, self.v, self.out = (nn.Linear(width, width)
                                          for _ in range(4))
      self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width,
                                                                  width)
      self.drop = nn.Dropout(dropout)

    def forward(self, x):
      b, t, d = x.shape
      h = self.ln1(x)
      split = lambda y: y.view(b, t, heads, d // heads).transpose(1, 2)  # noqa: E731
      a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)),
                                         split(self.v(h)), is_causal=True)
      x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
      h = self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
      return x + self.drop(h)

  class CharTransformer(nn.Module):
    def __init__(self):
      super().__init__()
      self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq_len,
                                                                    width)
      self.blocks = nn.ModuleList(Block() for _ in range(depth))
      self.ln = nn.LayerNorm(width, eps=1e-6)
      self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens, targets):
      x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
      for block in self.blocks:
        x = block(x)
      logits = self.head(self.ln(x))
      return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

  return CharTransformer()


def _mx_round_trip(x, axis: int):
  """``x`` quantized to MXFP8 by torchao (``MXTensor.to_mx``: E4M3, 32 per
  E8M0 scale, RCEIL: the scale rounded up) along ``axis``, dequantized."""
  import torch  # pylint: disable=import-outside-toplevel
  from torchao.prototype.mx_formats.config import ScaleCalculationMode  # pylint: disable=import-outside-toplevel
  from torchao.prototype.mx_formats.mx_tensor import MXTensor  # pylint: disable=import-outside-toplevel
  moved = x.movedim(axis, -1).contiguous()
  flat = moved.reshape(-1, moved.shape[-1])
  mx = MXTensor.to_mx(flat, torch.float8_e4m3fn, 32,
                      scaling_mode=ScaleCalculationMode.RCEIL)
  return mx.dequantize(x.dtype).reshape(moved.shape).movedim(-1, axis)


def mx_linear_function():
  """torchao's emulated MXFP8 training of a Linear, written out as torchao's
  ``MXLinear`` did (torchao 0.18 keeps the quantization, ``MXTensor``, and
  moved its dense training recipe out): the forward, input-gradient and
  weight-gradient GEMMs each read operands quantized along their own
  contraction axis, E4M3 everywhere, multiplied in high precision."""
  import torch  # pylint: disable=import-outside-toplevel

  class MXLinear(torch.autograd.Function):
    # Operands in bf16 (the autocast dtype), quantized from it, multiplied
    # in fp32 (the dequantized products are exact there).
    @staticmethod
    def forward(ctx, x, w, b):
      x, wq = x.to(torch.bfloat16), w.to(torch.bfloat16)
      ctx.save_for_backward(x, wq)
      ctx.dtypes = (w.dtype, None if b is None else b.dtype)
      y = _mx_round_trip(x.float(), -1) @ _mx_round_trip(wq.float(), -1).t()
      return (y if b is None else y + b.float()).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
      x, w = ctx.saved_tensors
      g2 = g.to(torch.bfloat16).float().reshape(-1, g.shape[-1])
      x2 = x.float().reshape(-1, x.shape[-1])
      dx = _mx_round_trip(g2, -1) @ _mx_round_trip(w.float(), 0)  # along N
      dw = _mx_round_trip(g2, 0).t() @ _mx_round_trip(x2, 0)      # along M
      db = None if ctx.dtypes[1] is None else g2.sum(0).to(ctx.dtypes[1])
      return (dx.reshape(x.shape).to(torch.bfloat16),
              dw.to(ctx.dtypes[0]), db)

  return MXLinear.apply


def use_mx_linears(model) -> None:
  """Every Linear of the blocks (not the head: jmp_lab's head is the loss
  kernel's bf16 GEMM) runs :func:`mx_linear_function`."""
  apply = mx_linear_function()
  for block in model.blocks:
    for linear in (block.q, block.k, block.v, block.out, block.fc,
                   block.proj):
      linear.forward = (lambda x, lin=linear: apply(x, lin.weight, lin.bias))


def make_optimizer(name: str, params, lr: float):
  import torch  # pylint: disable=import-outside-toplevel
  kwargs = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
  if name == "AdamW":
    return torch.optim.AdamW(params, **kwargs)
  from torchao import optim  # pylint: disable=import-outside-toplevel
  return getattr(optim, name)(params, **kwargs)


def train(data: str, optimizer: str, steps: int, batch_size: int,
          seq_len: int, lr: float, seed: int = 0, mx: bool = False,
          bf16: bool = False) -> dict:
  import contextlib  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  arrays = np.load(data)
  train_tokens, valid = arrays["train"], torch.as_tensor(
      arrays["valid"], dtype=torch.long)
  torch.manual_seed(seed)
  model = build_model(seq_len)
  if mx:
    use_mx_linears(model)
  compute = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else (
      contextlib.nullcontext)
  opt = make_optimizer(optimizer, model.parameters(), lr)
  total = max(steps, 100)
  warmup = 50

  def schedule(step):  # optax.warmup_cosine_decay_schedule(0, lr, 50, total)
    if step < warmup:
      return step / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

  sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
  rng = np.random.default_rng(0)   # the example's batches
  window, curve = seq_len + 1, []
  for step in range(steps):
    starts = rng.integers(0, len(train_tokens) - window, batch_size)
    batch = torch.as_tensor(np.stack([train_tokens[s:s + window]
                                      for s in starts]), dtype=torch.long)
    model.train()
    with compute():
      loss = model(batch[:, :-1], batch[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if (step + 1) % 20 == 0:
      model.eval()
      with torch.no_grad(), compute():
        curve.append((step + 1, float(model(valid[:, :-1], valid[:, 1:]))))
  return {"optimizer": optimizer, "mx": mx, "bf16": bf16,
          "loss": curve[-1][1], "curve": curve}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=["export", "train"])
  parser.add_argument("data")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--optimizers", default="AdamW,AdamW8bit,AdamWFp8")
  parser.add_argument("--seed", type=int, default=0,
                      help="torch's seed (the initial weights, dropout)")
  parser.add_argument("--mxfp8", action="store_true",
                      help="the MXFP8 comparison instead: AdamW under bf16 "
                           "autocast, without and with torchao's MXFP8 "
                           "quantization of every block's Linear")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  if args.mode == "export":
    export(args.data, args.seq_len)
    return
  results = []
  runs = ([("AdamW", False), ("AdamW", True)] if args.mxfp8 else
          [(name, False) for name in args.optimizers.split(",")])
  for name, mx in runs:
    result = train(args.data, name, args.steps, args.batch_size, args.seq_len,
                   args.lr, seed=args.seed, mx=mx, bf16=args.mxfp8)
    results.append(result)
    base = results[0]["loss"]
    name = f"{name}{' + MXFP8' if mx else ''}{' (bf16)' if args.mxfp8 else ''}"
    print(f"{name}: valid loss {result['loss']:.4f} "
          f"({result['loss'] / base - 1:+.2%} vs {results[0]['optimizer']})",
          flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f)


if __name__ == "__main__":
  sys.exit(main())
