"""MXFP8 and NVFP4 training against bf16 on the char transformer, and the
NVFP4 recipe's ablation (each piece switched off in turn).

Runs ``examples/char_transformer.py`` (the standard library's Python
sources as bytes) under ``mixed_bfloat16``, ``mixed_mxfp8`` and
``mixed_nvfp4``, the last also with :func:`jmp_lab.block_scaled.nvfp4_recipe`
switching off 16x16 weight tiles, stochastic rounding, the Hadamard
transform, and both of the last two, and switching on Four Over Six. On a
CPU the block-scaled GEMMs are emulated with the GPU's numbers
(``jmp_lab.block_scaled``). Prints the validation losses and their ratios
to bf16's, each measured twice: in the run's own policy (the forward
quantized as in training) and with the trained weights' matmuls in bf16 (how
well the format trained them). ``--width``, ``--depth`` and ``--heads``
train another size, ``--lr`` at another peak learning rate::

  PYTHONPATH=.:examples python benchmarks/block_scaled_accuracy.py \\
      --steps 2000 --batch-size 8 --seq-len 64 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import char_transformer  # noqa: E402
from jmp_lab import block_scaled  # noqa: E402

# (row, policy, the recipe's switches: a context of jmp_lab.block_scaled,
# or None[, the layers kept in bf16]). The first is the baseline.
RUNS = [
    ("bf16", "mixed_bfloat16", None),
    ("mxfp8", "mixed_mxfp8", None),
    ("mxfp8 with 1x32 weight blocks per GEMM", "mixed_mxfp8",
     lambda: block_scaled.mxfp8_recipe(weight_tiles=False)),
    ("nvfp4 (full recipe)", "mixed_nvfp4", None),
    ("nvfp4 without RHT and SR", "mixed_nvfp4",
     lambda: block_scaled.nvfp4_recipe(hadamard=False,
                                       stochastic_rounding=False)),
    ("nvfp4 without RHT", "mixed_nvfp4",
     lambda: block_scaled.nvfp4_recipe(hadamard=False)),
    ("nvfp4 without SR", "mixed_nvfp4",
     lambda: block_scaled.nvfp4_recipe(stochastic_rounding=False)),
    ("nvfp4 without 16x16 weight tiles", "mixed_nvfp4",
     lambda: block_scaled.nvfp4_recipe(weight_tiles=False)),
    # The paper's layer choice: its last blocks in bf16 (here the last of
    # two blocks; the head is bf16 in every row).
    ("nvfp4, the last block bf16", "mixed_nvfp4", None, "Block_1"),
    ("nvfp4 with four over six", "mixed_nvfp4",
     lambda: block_scaled.nvfp4_recipe(four_over_six=True)),
    ("nvfp4 with four over six, without RHT and SR", "mixed_nvfp4",
     lambda: block_scaled.nvfp4_recipe(four_over_six=True, hadamard=False,
                                       stochastic_rounding=False)),
]


def run(policy: str, recipe, steps: int, batch: int, seq_len: int,
        seed: int, model_flags: list[str], bf16_layers: str = ""
        ) -> tuple[float, float]:
  """The run's validation loss in its own policy, and its trained weights'
  with bf16 matmuls."""
  ablated = recipe() if recipe else contextlib.nullcontext()
  kept = ["--bf16-layers", bf16_layers] if bf16_layers else []
  with tempfile.TemporaryDirectory() as ckpt, ablated:
    out = char_transformer.main(
        ["--policy", policy, "--steps", str(steps), "--batch-size",
         str(batch), "--seq-len", str(seq_len), "--seed", str(seed),
         "--ckpt-dir", ckpt, "--ckpt-every", str(10**9), "--no-progress",
         "--sample-len", "0", *model_flags, *kept])
  return out["valid_loss"], out["valid_loss_bf16"]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--only", default=None,
                      help="'|'-separated row names to run (bf16 always)")
  parser.add_argument("--bf16-loss", type=float, default=None,
                      help="the bf16 row's loss from an earlier run of the "
                           "same flags (skips running it again)")
  parser.add_argument("--width", type=int, default=None,
                      help="the example's --width (default: its own)")
  parser.add_argument("--depth", type=int, default=None,
                      help="the example's --depth (default: its own)")
  parser.add_argument("--heads", type=int, default=None,
                      help="the example's --heads (default: its own)")
  parser.add_argument("--lr", type=float, default=None,
                      help="the example's peak --lr (default: its own)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  model_flags = [f"--{flag}={getattr(args, flag)}" for flag in
                 ("width", "depth", "heads", "lr")
                 if getattr(args, flag) is not None]
  wanted = None if args.only is None else set(args.only.split("|"))
  losses = {} if args.bf16_loss is None else {"bf16": args.bf16_loss}
  # The trained weights' loss with bf16 matmuls: how well the format trained
  # them, without its forward's quantization at evaluation.
  weights_in_bf16 = dict(losses)
  for name, policy, recipe, *kept in RUNS:
    if name in losses:
      continue
    if wanted is not None and name != "bf16" and name not in wanted:
      continue
    losses[name], weights_in_bf16[name] = run(
        policy, recipe, args.steps, args.batch_size, args.seq_len, args.seed,
        model_flags, *kept)
    print(f"{name:<34} valid loss {losses[name]:.4f}  vs bf16 "
          f"{losses[name] / losses['bf16']:.4f}x;  its weights with bf16 "
          f"matmuls {weights_in_bf16[name]:.4f}  vs bf16 "
          f"{weights_in_bf16[name] / losses['bf16']:.4f}x", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "valid_loss": losses,
                 "valid_loss_weights_in_bf16": weights_in_bf16}, f, indent=1)
  return losses


if __name__ == "__main__":
  main()
