"""The seeds' SimpleCNN on scikit-learn's handwritten digits, under each policy.

The 1,797 8x8 digits that scikit-learn ships are resized to 28x28, so the
network is exactly the seeds' SimpleCNN (two 5x5 convolutions with max
pooling, 1024 flattened features, two dense layers). Nothing is downloaded.

  python examples/digits_cnn.py                      # mixed_float16, dynamic
  python examples/digits_cnn.py --policy float32 --loss-scale none
  python examples/digits_cnn.py --compare            # every policy + a table

``--compare`` trains float32, mixed_bfloat16 and mixed_float16 with dynamic
loss scaling, plus mixed_float16 with no loss scaling, and prints final test
accuracy, final loss, skipped steps, final loss scale, steps/s and the
compiled step's peak memory for each; it writes a PNG of the loss curves and
the loss-scale traces.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import jmp_lab
from common import POLICY_HELP, policy_spec
from jmp_lab import linen as jl

COMPARE_RUNS = [("float32", "none"), ("mixed_bfloat16", "dynamic"),
                ("mixed_float16", "dynamic"), ("mixed_float16", "static"),
                ("mixed_float16", "none")]


class SimpleCNN(nn.Module):
  """The seeds' SimpleCNN, in Flax: conv-pool-conv-pool-dense-dense."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.max_pool(nn.Conv(32, (5, 5), padding="VALID")(x), (2, 2), (2, 2)))
    x = nn.relu(nn.max_pool(nn.Conv(64, (5, 5), padding="VALID")(x), (2, 2), (2, 2)))
    x = x.reshape((x.shape[0], -1))  # 4 * 4 * 64 = 1024, as in the seed
    x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(10)(x)


def load_data(seed: int = 0):
  """scikit-learn's digits, resized to 28x28, split 80/20 (train/test)."""
  digits = load_digits()
  images = jax.image.resize(jnp.asarray(digits.images / 16.0, jnp.float32),
                            (len(digits.images), 28, 28), "bilinear")
  x = np.asarray(images)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  split = int(0.8 * len(x))
  return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def make_loss_scale(kind: str):
  if kind == "dynamic":
    return jmp_lab.DynamicLossScale(2.0**15, growth_interval=50)
  if kind == "static":
    return jmp_lab.StaticLossScale(2.0**10)
  if kind == "none":
    return jmp_lab.NoOpLossScale()
  raise ValueError(f"--loss-scale must be dynamic, static or none, got {kind!r}")


def loss_fn(params, state, batch):
  logits = state.apply_fn({"params": params}, batch["x"])
  loss = jl.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss


def make_optimizer(optimizer: str, policy, loss_scale, *, lr: float = 1e-3,
                   **lean):
  """``fused_adamw`` or ``mixed_precision(optax.adam)``; ``lean`` holds the
  memory-lean options (``master``, ``rounding``, ``mu_dtype``, and
  ``nu_dtype`` for the fused optimizer only: optax has none)."""
  lean = {k: v for k, v in lean.items() if v is not None}
  if optimizer == "fused":
    return jmp_lab.fused_adamw(lr, weight_decay=0.0, policy=policy,
                               loss_scale=loss_scale, **lean)
  if "nu_dtype" in lean:
    raise ValueError(
        f"nu_dtype={lean['nu_dtype']!r} needs the fused optimizer: optax.adam "
        f"has a mu_dtype but no nu_dtype (optax issue 1552)")
  mu_dtype = lean.pop("mu_dtype", None)
  return jmp_lab.mixed_precision(optax.adam(lr, mu_dtype=mu_dtype),
                                 policy=policy, loss_scale=loss_scale, **lean)


def train(policy_name: str, loss_scale_kind: str, *, epochs: int,
          batch_size: int, optimizer: str, seed: int = 0,
          data=None, progress: bool = True, lr: float = 1e-3,
          **lean) -> dict[str, Any]:
  """Trains SimpleCNN once; returns the figures and the per-step traces.

  ``lean``: ``master``, ``rounding``, ``mu_dtype``, ``nu_dtype`` (see
  :func:`make_optimizer`).
  """
  policy = jmp_lab.get_policy(policy_name)
  (x_train, y_train), (x_test, y_test) = data or load_data()
  model = jl.with_policy(SimpleCNN(), policy)
  params = model.init(jax.random.key(seed), x_train[:1])["params"]
  tx = make_optimizer(optimizer, policy, make_loss_scale(loss_scale_kind),
                      lr=lr, **lean)
  state = jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=tx, policy=policy)
  step = jmp_lab.make_train_step(loss_fn)

  steps_per_epoch = len(x_train) // batch_size
  total = epochs * steps_per_epoch
  rng = np.random.default_rng(seed)
  batches = [rng.permutation(len(x_train))[:steps_per_epoch * batch_size]
             .reshape(steps_per_epoch, batch_size) for _ in range(epochs)]
  first = {"x": x_train[batches[0][0]], "y": y_train[batches[0][0]]}
  compiled = step.lower(state, first).compile()
  peak = jmp_lab.diagnostics.compiled_memory(compiled)["peak"]

  recorder = jmp_lab.diagnostics.TrainingRecorder()
  losses, scales, skipped = [], [], []
  bar = tqdm(total=total, desc=f"{policy_name}/{loss_scale_kind}",
             disable=not progress, leave=False)
  start = None
  for epoch_batches in batches:
    for idx in epoch_batches:
      state, metrics = compiled(state, {"x": x_train[idx], "y": y_train[idx]})
      if start is None:  # time from the end of the first step
        jax.block_until_ready(metrics)
        start = time.perf_counter()
      losses.append(metrics["loss"])
      scales.append(metrics["loss_scale"])
      skipped.append(metrics["skipped_steps"])
      recorder.record(metrics)  # keeps device arrays: no sync
      bar.update()
      if len(losses) % 10 == 0:  # read a step that is already done: no stall
        bar.set_postfix(loss=f"{float(losses[-2]):.3f}",
                        scale=f"{float(scales[-2]):.0f}")
  jax.block_until_ready(state)
  seconds = time.perf_counter() - start
  bar.close()

  logits = model.apply({"params": state.params}, x_test)
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  test_loss = float(jl.softmax_cross_entropy_with_integer_labels(
      logits, jnp.asarray(y_test)).mean())
  losses = np.asarray(jax.device_get(losses), np.float64)
  return {
      "policy": policy_name,
      "loss_scale": loss_scale_kind,
      "test_accuracy": accuracy,
      "test_loss": test_loss,
      "final_loss": float(np.mean(losses[-steps_per_epoch:])),
      "skipped_steps": int(skipped[-1]),
      "final_scale": float(scales[-1]),
      "steps_per_s": (total - 1) / seconds,
      "peak_memory_bytes": peak,
      "losses": losses,
      "scales": np.asarray(jax.device_get(scales), np.float64),
      "state": state,
      "recorder": recorder,
      "step": step,
      "example_batch": first,
      "model": model,
  }


def diagnose(result, x_train, y_train, out_dir: str) -> None:
  """Writes the gradient histogram and prints the audit of the train step."""
  state = result["state"]
  batch = {"x": x_train[:256], "y": y_train[:256]}
  # Unscaled gradients at the final params: what fp16 would have to hold.
  grads = jax.grad(lambda p: loss_fn(p, state, batch))(state.params)
  hist = jmp_lab.diagnostics.gradient_histogram(grads)
  scale = result["final_scale"]
  print(f"gradients of {result['policy']}: {100 * hist.share_underflowing(1.0):.2f}% "
        f"would flush to zero in fp16 unscaled, "
        f"{100 * hist.share_underflowing(scale):.2f}% at loss scale {scale:g}; "
        f"scales keeping all representable: "
        f"[{hist.safe_scales()[0]:.3g}, {hist.safe_scales()[1]:.3g}]")
  path = os.path.join(out_dir, "digits_grad_hist.png")
  jmp_lab.diagnostics.plot_gradient_histogram(
      hist, loss_scale=scale,
      title=f"SimpleCNN gradients ({result['policy']})").savefig(path, dpi=120)
  print(f"wrote {path}")
  trace_path = os.path.join(out_dir, "digits_trace.png")
  result["recorder"].plot(trace_path)
  print(f"wrote {trace_path}")
  audit = jmp_lab.diagnostics.audit_step(result["step"], state,
                                         result["example_batch"],
                                         policy=result["policy"])
  print(f"audit of the jitted train step ({result['policy']}):")
  print(audit.table())


def print_table(results) -> str:
  lines = ["| policy | loss scale | test acc | final loss | skipped | final scale "
           "| steps/s | peak memory |",
           "|---|---|---|---|---|---|---|---|"]
  for r in results:
    lines.append(
        f"| {r['policy']} | {r['loss_scale']} | {100 * r['test_accuracy']:.2f}% "
        f"| {r['final_loss']:.4f} | {r['skipped_steps']} | {r['final_scale']:g} "
        f"| {r['steps_per_s']:.1f} | {r['peak_memory_bytes'] / 2**20:.2f} MiB |")
  table = "\n".join(lines)
  print(table)
  return table


def plot(results, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
  # Distinct styles: runs whose curves coincide (every scale of 1 without
  # scaling) stay visible under each other.
  styles = ["-", "--", "-.", ":", (0, (5, 1))]
  for i, r in enumerate(results):
    label = f"{r['policy']} / {r['loss_scale']}"
    style = styles[i % len(styles)]
    ax_loss.plot(r["losses"], label=label, lw=1, ls=style)
    ax_scale.step(np.arange(len(r["scales"])), r["scales"], label=label,
                  lw=1.5, ls=style, where="post")
  ax_loss.set(xlabel="step", ylabel="training loss", yscale="log",
              title="SimpleCNN on scikit-learn digits")
  ax_scale.set_yscale("log", base=2)
  ax_scale.set(xlabel="step", ylabel="loss scale",
               title="loss-scale trace (a halving is a skipped step)")
  ax_loss.legend(fontsize=8)
  ax_scale.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", default="mixed_float16", type=policy_spec,
                      help=POLICY_HELP)
  parser.add_argument("--loss-scale", default="dynamic",
                      choices=["dynamic", "static", "none"],
                      help="dynamic (torch GradScaler's rules), a static "
                           "scale of 1024, or none")
  parser.add_argument("--compare", action="store_true",
                      help="run every policy (and fp16 without scaling) and "
                           "write digits_cnn_compare.png")
  parser.add_argument("--epochs", type=int, default=6,
                      help="passes over the 1,437 training images")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--optimizer", default="fused", choices=["fused", "optax"],
                      help="jmp_lab.fused_adamw or mixed_precision(optax.adam)")
  parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
  parser.add_argument("--master", default=None,
                      choices=["float32", "remainder", "none"],
                      help="how the fp32 master is kept (bf16 params for "
                           "remainder/none: --policy p=bf16,c=bf16,o=f32)")
  parser.add_argument("--rounding", default=None,
                      choices=["nearest", "stochastic"],
                      help="rounding of the params with --master none")
  parser.add_argument("--mu-dtype", default=None, choices=["bfloat16"],
                      help="Adam's first moment in bf16")
  parser.add_argument("--nu-dtype", default=None, choices=["bfloat16"],
                      help="Adam's second moment in bf16 (the fused "
                           "optimizer only)")
  parser.add_argument("--out-dir", default=os.path.join("examples", "out"),
                      help="where the plots go")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar")
  args = parser.parse_args(argv)

  runs = COMPARE_RUNS if args.compare else [(args.policy, args.loss_scale)]
  data = load_data()
  lean = dict(master=args.master, rounding=args.rounding,
              mu_dtype=args.mu_dtype, nu_dtype=args.nu_dtype)
  results = [train(p, s, epochs=args.epochs, batch_size=args.batch_size,
                   optimizer=args.optimizer, data=data, lr=args.lr,
                   progress=not args.no_progress, **lean) for p, s in runs]
  print(f"# SimpleCNN, scikit-learn digits (28x28), {args.epochs} epochs, batch "
        f"{args.batch_size}, optimizer {args.optimizer}, {jax.devices()[0].device_kind}")
  print_table(results)
  for r in results:
    print(f"{r['policy']} / {r['loss_scale']}: {r['recorder'].describe()}")
  os.makedirs(args.out_dir, exist_ok=True)
  # One file per mode: a single run does not overwrite --compare's plot.
  name = ("digits_cnn_compare" if args.compare else
          f"digits_cnn_{args.policy}_{args.loss_scale}".replace(",", "_")
          .replace("=", "-"))
  plot(results, os.path.join(args.out_dir, name + ".png"))
  half = [r for r in results if r["policy"] != "float32"] or results
  diagnose(half[0], *data[0], args.out_dir)
  return results


if __name__ == "__main__":
  main()
