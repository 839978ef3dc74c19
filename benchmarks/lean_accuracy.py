"""Accuracy of the memory-lean masters on real data (issue 13).

Trains ``examples/char_transformer.py`` (the standard library's Python
sources, bf16 params and compute) with every ``mixed_precision`` master mode,
the same seeds, batches and steps, and prints the final validation loss of
each against the fp32 master:

* at the example's learning rate (3e-3), where every mode should agree;
* at a small learning rate (1e-4), where Adam's steps fall below half a bf16
  ulp for most weights, so round-to-nearest without a master stalls.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/lean_accuracy.py --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import char_transformer  # noqa: E402

MODES = [
    ("fp32 master", ["--master", "float32"]),
    ("remainder", ["--master", "remainder"]),
    ("remainder + bf16 mu", ["--master", "remainder", "--mu-dtype", "bfloat16"]),
    ("none, nearest", ["--master", "none"]),
    ("none, stochastic", ["--master", "none", "--rounding", "stochastic"]),
]


def run(mode_args, steps: int, lr: float) -> float:
  with tempfile.TemporaryDirectory() as ckpt:
    out = char_transformer.main(
        ["--policy", "p=bf16,c=bf16,o=f32", "--steps", str(steps), "--lr",
         str(lr), "--ckpt-dir", ckpt, "--ckpt-every", str(10**9),
         "--no-progress", "--sample-len", "0"] + mode_args)
  return out["valid_loss"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lrs", default="3e-3,1e-4")
  args = parser.parse_args(argv)
  rows = []
  for lr in map(float, args.lrs.split(",")):
    modes = MODES if lr >= 1e-3 else [m for m in MODES
                                      if m[0] in ("fp32 master", "none, nearest",
                                                  "none, stochastic")]
    base = None
    for name, mode_args in modes:
      loss = run(mode_args, args.steps, lr)
      base = loss if base is None else base
      rows.append((lr, name, loss, loss / base - 1))
  print(f"| lr | master | valid loss after {args.steps} steps (nats/char) "
        f"| vs fp32 master |")
  print("|---|---|---|---|")
  for lr, name, loss, rel in rows:
    print(f"| {lr:g} | {name} | {loss:.4f} | {rel:+.2%} |")


if __name__ == "__main__":
  main()
