"""The attention kernels, and the blockwise loss, compiled for an H100.

For each ``jmp_lab.attention`` implementation (cuDNN, Pallas Triton, Mosaic
GPU, and the materialized ``xla`` path), one layer's causal attention is
compiled for the target on a CPU-only machine, forward and backward. The
shapes are GPT-2-small's by default: batch 8, T 1024, 12 heads of 64, bf16.
For each the script prints bytes, temporaries, kernels and compile seconds.
With ``--loss`` it does the same for ``jmp_lab.losses.linear_cross_entropy``
(XLA's path at several block sizes, and its Pallas Triton kernels, which
``"auto"`` runs on CUDA) against the stored-logits cross-entropy (8,192 tokens,
width 768, vocabulary 50,304).

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/attention.py --loss

These are compiled figures, a model of the GPU program, not timings.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import optax

import jmp_lab
from jmp_lab import attention, losses
from jmp_lab._src.numerics import losses as losses_impl  # the block size it picks


def _row(name, fn, *args, target):
  start = time.perf_counter()
  try:
    report = jmp_lab.diagnostics.compiled_report(fn, *args, target=target)
  except Exception as e:  # pylint: disable=broad-except  (a kernel's limits)
    return f"| {name} | did not compile: {str(e).splitlines()[0][:120]} |"
  seconds = time.perf_counter() - start
  custom = sorted({k.op_name.rsplit("/", 1)[-1] for k in report.kernel_records
                   if k.opcode == "custom-call"})
  return (f"| {name} | {report.bytes_accessed / 1e9:.3f} | "
          f"{report.memory.get('temp', 0) / 2**20:.0f} | {report.kernels} | "
          f"{seconds:.1f} | {', '.join(custom) or '-'} |")


def attention_rows(args) -> list[str]:
  shape = (args.batch, args.seq_len, args.heads, args.head_dim)
  q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  rows = ["| attention (forward + backward) | GB | temp MiB | kernels | "
          "compile s | custom calls |", "|---|---|---|---|---|---|"]
  for implementation in ("cudnn", "triton", "mosaic", "xla"):
    attend = functools.partial(attention.dot_product_attention, causal=True,
                               implementation=implementation)
    loss = lambda q, k, v, f=attend: f(q, k, v).astype(  # noqa: E731
        jnp.float32).sum()
    rows.append(_row(implementation, jax.grad(loss, argnums=(0, 1, 2)), q, q,
                     q, target=args.target))
  return rows


def loss_rows(args) -> list[str]:
  hidden = jax.ShapeDtypeStruct((args.tokens, args.width), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((args.vocab, args.width), jnp.float32)
  labels = jax.ShapeDtypeStruct((args.tokens,), jnp.int32)

  def stored(h, table, y):
    logits = h @ table.astype(h.dtype).T
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean()

  rows = ["| loss (forward + backward) | GB | temp MiB | kernels | compile s "
          "| custom calls |", "|---|---|---|---|---|---|"]
  rows.append(_row("stored logits", jax.grad(stored, argnums=(0, 1)), hidden,
                   table, labels, target=args.target).replace(
                       "| cublas", "| cublas"))
  for block in (4096, 8384, 16768, None):
    fn = lambda h, t, y, b=block: losses.linear_cross_entropy(  # noqa: E731
        h, t.T, y, block_size=b, implementation="xla").mean()
    name = (f"linear_cross_entropy, XLA, block {block}" if block else
            f"linear_cross_entropy, XLA, default block "
            f"({losses_impl._block_size(args.vocab, None)})")
    rows.append(_row(name, jax.grad(fn, argnums=(0, 1)), hidden, table,
                     labels, target=args.target))
  fused = lambda h, t, y: losses.linear_cross_entropy(  # noqa: E731
      h, t.T, y).mean()
  rows.append(_row("linear_cross_entropy, Pallas Triton kernels (auto)",
                   jax.grad(fused, argnums=(0, 1)), hidden, table, labels,
                   target=args.target))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--loss", action="store_true")
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--width", type=int, default=768)
  parser.add_argument("--vocab", type=int, default=50304)
  args = parser.parse_args(argv)
  rows = attention_rows(args)
  if args.loss:
    rows += [""] + loss_rows(args)
  print("\n".join(rows))
  return rows


if __name__ == "__main__":
  main()
