"""Quick start: a small Flax CNN on scikit-learn's handwritten digits, in fp16.

Shows the jmp_lab API end to end in one jitted, donated step:

* ``jmp_lab.linen.with_policy`` runs the unmodified module in the compute
  dtype (norms in fp32) and returns logits in the output dtype;
* ``jmp_lab.mixed_precision`` keeps fp32 master weights and a dynamic loss
  scale inside the optax state, and skips steps whose gradients overflow;
* ``jmp_lab.make_train_step`` differentiates the scaled loss and applies it.

Run:  python examples/quickstart.py [--policy mixed_float16] [--steps 300]
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jmp_lab
from common import POLICY_HELP, policy_spec
from jmp_lab import linen as jl


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.LayerNorm()(x)
    x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def load_data(seed: int = 0):
  """The 1,797 8x8 digits that scikit-learn ships, split 80/20."""
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  split = int(0.8 * len(x))
  return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def loss_fn(params, state, batch):
  logits = state.apply_fn({"params": params}, batch["x"])
  loss = jl.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", default="mixed_float16", type=policy_spec,
                      help=POLICY_HELP)
  parser.add_argument("--steps", type=int, default=300, help="train steps")
  parser.add_argument("--batch-size", type=int, default=128)
  args = parser.parse_args(argv)

  policy = jmp_lab.get_policy(args.policy)
  (x_train, y_train), (x_test, y_test) = load_data()
  model = jl.with_policy(CNN(), policy)
  params = model.init(jax.random.key(0), x_train[:1])["params"]
  tx = jmp_lab.mixed_precision(
      optax.adamw(1e-3), policy=policy,
      loss_scale=jmp_lab.DynamicLossScale(2.0**15, growth_interval=100))
  state = jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=tx, policy=policy)
  train_step = jmp_lab.make_train_step(loss_fn)

  rng = np.random.default_rng(0)
  print(f"policy: {policy}")
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(x_train), args.batch_size)
    state, metrics = train_step(state, {"x": x_train[idx], "y": y_train[idx]})
    if step % 100 == 0 or step == args.steps:
      print(f"step {step:4d}  loss {float(metrics['loss']):.4f}  "
            f"loss scale {float(metrics['loss_scale']):.0f}  "
            f"skipped {int(metrics['skipped_steps'])}")
  logits = model.apply({"params": state.params}, x_test)
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  print(f"test accuracy: {accuracy:.3f}")
  return accuracy


if __name__ == "__main__":
  main()
