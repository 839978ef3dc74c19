"""Accuracy of the memory-lean masters on real data (issue 13).

Trains two examples with every master mode of both optimizers, bf16 params
and compute, the same seeds, batches and steps, and prints the final
validation loss of each against the fp32 master of ``mixed_precision``:

* ``examples/char_transformer.py`` (the standard library's Python sources),
  validation loss on held-out text, recorded every 20 steps for the curves;
* ``examples/digits_cnn.py`` (the seeds' SimpleCNN on scikit-learn's digits),
  loss and accuracy on the held-out 20%.

Each at the example's learning rate, where every mode should agree, and at a
small one, where Adam's steps fall below half a bf16 ulp for most weights, so
round-to-nearest without a master stalls. It writes a PNG of the curves.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/lean_accuracy.py \\
      --plot benchmarks/lean_accuracy.png

``--eight-bit`` compares the moment dtypes on the char transformer alone;
with ``--seeds 0,1,2`` a row is the mean over init/dropout seeds (each seed's
loss listed beside it), and ``--valid-windows 256`` validates on 16 times the
held-out text (the command in ``benchmarks/RESULTS.md``, "8-bit optimizer
states").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import char_transformer  # noqa: E402
import digits_cnn  # noqa: E402

POLICY = "p=bf16,c=bf16,o=f32"

# (name, fused?, lean options). The first is the baseline.
MODES = [
    ("fp32 master", False, dict(master="float32")),
    ("remainder", False, dict(master="remainder")),
    ("remainder + bf16 mu", False, dict(master="remainder", mu_dtype="bfloat16")),
    ("none, nearest", False, dict(master="none", rounding="nearest")),
    ("none, stochastic", False, dict(master="none", rounding="stochastic")),
    ("fused: fp32 master", True, dict(master="float32")),
    ("fused: remainder + bf16 mu, nu", True,
     dict(master="remainder", mu_dtype="bfloat16", nu_dtype="bfloat16")),
    ("fused: none, stochastic + bf16 mu, nu", True,
     dict(master="none", rounding="stochastic", mu_dtype="bfloat16",
          nu_dtype="bfloat16")),
    # 8-bit moments (issue 46), block-quantized.
    ("fused: remainder + int8 mu, nu", True,
     dict(master="remainder", mu_dtype="int8", nu_dtype="int8")),
    ("fused: remainder + fp8 mu, nu", True,
     dict(master="remainder", mu_dtype="float8_e4m3fn",
          nu_dtype="float8_e4m3fn")),
    ("fused: none, stochastic + int8 mu, nu", True,
     dict(master="none", rounding="stochastic", mu_dtype="int8",
          nu_dtype="int8")),
]
# The char transformer's rows that --eight-bit runs (the moments compared).
EIGHT_BIT_MODES = ("fp32 master", "fused: fp32 master",
                   "fused: remainder + bf16 mu, nu",
                   "fused: remainder + int8 mu, nu",
                   "fused: remainder + fp8 mu, nu",
                   "fused: none, stochastic + int8 mu, nu")
# At the small learning rate: the baseline and the modes without a master.
SMALL_LR_MODES = ("fp32 master", "none, nearest", "none, stochastic",
                  "fused: none, stochastic + bf16 mu, nu")


def char_run(fused: bool, lean: dict, steps: int, lr: float,
             shape: tuple = (), seed: int = 0, eval_every: int = 20) -> dict:
  """``shape``: extra flags of the example (``--batch-size``, ...)."""
  flags = []
  for key, value in lean.items():
    flags += [f"--{key.replace('_', '-')}", value]
  with tempfile.TemporaryDirectory() as ckpt:
    out = char_transformer.main(
        ["--policy", POLICY, "--steps", str(steps), "--lr", str(lr),
         "--ckpt-dir", ckpt, "--ckpt-every", str(10**9), "--no-progress",
         "--sample-len", "0", "--eval-every", str(eval_every),
         "--seed", str(seed), *shape]
        + (["--fused"] if fused else []) + flags)
  curve = out["valid_curve"]
  if not curve or curve[-1][0] != out["step"]:
    curve = curve + [(out["step"], out["valid_loss"])]
  steps_, losses = zip(*curve)
  return {"loss": out["valid_loss"], "curve": (steps_, losses)}


def over_seeds(run, seeds) -> dict:
  """One mode run once a seed: the mean final loss, each seed's, and the mean
  curve. With one seed it is that run."""
  results = [run(seed) for seed in seeds]
  if len(results) == 1:
    return results[0]
  losses = [r["loss"] for r in results]
  steps_ = results[0]["curve"][0]
  return {"loss": float(np.mean(losses)), "seed_losses": losses,
          "curve": (steps_, tuple(np.mean([r["curve"][1] for r in results],
                                          axis=0)))}


def digits_run(fused: bool, lean: dict, epochs: int, lr: float, data) -> dict:
  out = digits_cnn.train(POLICY, "none", epochs=epochs, batch_size=64,
                         optimizer="fused" if fused else "optax", data=data,
                         progress=False, lr=lr, **lean)
  losses = out["losses"]
  smooth = np.convolve(losses, np.ones(10) / 10, mode="valid")
  return {"loss": out["test_loss"], "accuracy": out["test_accuracy"],
          "curve": (np.arange(len(smooth)) + 10, smooth)}


def table(title: str, rows, with_accuracy: bool) -> str:
  seeded = any("seed_losses" in result for _, _, result, _ in rows)
  head = ("| lr | mode | loss | vs fp32 master |"
          + (" each seed | spread (max - min) |" if seeded else "")
          + (" test accuracy |" if with_accuracy else ""))
  lines = [title, "", head, "|" + "---|" * (head.count("|") - 1)]
  for lr, name, result, rel in rows:
    line = f"| {lr:g} | {name} | {result['loss']:.4f} | {rel:+.2%} |"
    if seeded:
      each = result["seed_losses"]
      line += (f" {', '.join(f'{x:.4f}' for x in each)} |"
               f" {(max(each) - min(each)) / result['loss']:.2%} |")
    if with_accuracy:
      line += f" {100 * result['accuracy']:.2f}% |"
    lines.append(line)
  return "\n".join(lines)


def plot(panels, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  # One colour per mode in every panel (the small-lr panels have fewer).
  colours = {name: plt.get_cmap("tab10")(i) for i, (name, _, _) in enumerate(MODES)}
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6))
  for ax, (title, ylabel, rows) in zip(np.atleast_1d(axes), panels):
    for _, name, result, _ in rows:
      x, y = result["curve"]
      ax.plot(x, y, lw=1.2, label=name, color=colours[name],
              ls="--" if name.startswith("fused") else "-")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f"wrote {path}")


def write_json(path: str, **tables) -> None:
  """Every row with its curve, so the figures can be re-plotted."""
  def plain(rows):
    return [{"lr": lr, "mode": name, "rel": rel, "loss": result["loss"],
             "accuracy": result.get("accuracy"),
             "seed_losses": result.get("seed_losses"),
             "curve": [np.asarray(c, np.float64).tolist()
                       for c in result["curve"]]}
            for lr, name, result, rel in rows]
  with open(path, "w") as f:
    json.dump({name: plain(rows) for name, rows in tables.items()}, f)


def sweep(run, lrs, only=None) -> list:
  rows = []
  for lr in lrs:
    modes = MODES if lr == lrs[0] else [m for m in MODES
                                        if m[0] in SMALL_LR_MODES]
    if only is not None:
      modes = [m for m in modes if m[0] in only]
    base = None
    for name, fused, lean in modes:
      result = run(fused, lean, lr)
      base = result["loss"] if base is None else base
      rows.append((lr, name, result, result["loss"] / base - 1))
      print(f"  {lr:g} {name}: {result['loss']:.4f}", flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--char-steps", type=int, default=200)
  parser.add_argument("--char-lrs", default="3e-3,1e-4")
  parser.add_argument("--digits-epochs", type=int, default=6)
  parser.add_argument("--digits-lrs", default="1e-3,1e-4")
  parser.add_argument("--plot", default=None, help="write the curves here")
  parser.add_argument("--char-batch", type=int, default=32)
  parser.add_argument("--char-seq-len", type=int, default=128)
  parser.add_argument("--eight-bit", action="store_true",
                      help="only the char transformer, at the first lr, "
                      "with the moment dtypes compared (fp32, bf16, 8-bit)")
  parser.add_argument("--json", default=None,
                      help="write every result and curve here")
  parser.add_argument("--seeds", default="0",
                      help="char transformer init/dropout seeds, comma "
                      "separated; a row is their mean (with each seed's loss)")
  parser.add_argument("--valid-windows", type=int, default=16,
                      help="held-out windows the char transformer's "
                      "validation loss averages over")
  parser.add_argument("--eval-every", type=int, default=20,
                      help="char transformer steps between validation points "
                      "of the curves")
  parser.add_argument("--modes", default=None,
                      help="with --eight-bit: the rows to run, ';' separated "
                      "(default: all of EIGHT_BIT_MODES); the first of them in "
                      "MODES is the baseline")
  args = parser.parse_args(argv)
  seeds = [int(x) for x in args.seeds.split(",")]
  eight_bit_modes = EIGHT_BIT_MODES
  if args.modes is not None:
    eight_bit_modes = tuple(m.strip() for m in args.modes.split(";"))
    unknown = [m for m in eight_bit_modes if m not in EIGHT_BIT_MODES]
    if unknown:
      parser.error(f"--modes: unknown {unknown}; choose from {EIGHT_BIT_MODES}")
  char_lrs = [float(x) for x in args.char_lrs.split(",")]
  digits_lrs = [float(x) for x in args.digits_lrs.split(",")]

  print("char transformer:")
  shape = ("--batch-size", str(args.char_batch), "--seq-len",
           str(args.char_seq_len), "--valid-windows", str(args.valid_windows))
  char_rows = sweep(lambda f, lean, lr: over_seeds(
                        lambda seed: char_run(f, lean, args.char_steps, lr,
                                              shape, seed, args.eval_every),
                        seeds),
                    char_lrs[:1] if args.eight_bit else char_lrs,
                    eight_bit_modes if args.eight_bit else None)
  if args.eight_bit:
    print(table(f"char transformer: validation loss (nats/char) after "
                f"{args.char_steps} steps", char_rows, with_accuracy=False))
    if args.json:
      write_json(args.json, char=char_rows)
    return
  print("digits CNN:")
  data = digits_cnn.load_data()
  digits_rows = sweep(
      lambda f, lean, lr: digits_run(f, lean, args.digits_epochs, lr, data),
      digits_lrs)

  print(table(f"char transformer: validation loss (nats/char) after "
              f"{args.char_steps} steps", char_rows, with_accuracy=False))
  print()
  print(table(f"digits CNN: test loss after {args.digits_epochs} epochs",
              digits_rows, with_accuracy=True))
  if args.json:
    write_json(args.json, char=char_rows, digits=digits_rows)
  if args.plot:
    panels = []
    for lr in char_lrs:
      panels.append((f"char transformer, lr {lr:g}", "validation loss",
                     [r for r in char_rows if r[0] == lr]))
    for lr in digits_lrs:
      panels.append((f"digits CNN, lr {lr:g}", "training loss (10-step mean)",
                     [r for r in digits_rows if r[0] == lr]))
    plot(panels, args.plot)


if __name__ == "__main__":
  main()
