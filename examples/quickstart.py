"""Quick start: a small Flax MLP on scikit-learn's handwritten digits.

Shows the two jmp_lab primitives by hand, in one jitted step:

* a precision policy casts params and inputs to the compute dtype and the
  logits to the output dtype;
* a dynamic loss scale scales the loss, unscales the gradients, and backs off
  (skipping the step) when they overflow.

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


class MLP(nn.Module):
  hidden: int = 128

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(10)(x)


def load_data(seed: int = 0):
  """The 1,797 8x8 digits that scikit-learn ships, split 80/20."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  split = int(0.8 * len(x))
  return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def make_train_step(model, tx, policy):
  @jax.jit
  def train_step(params, opt_state, loss_scale, x, y):
    def scaled_loss(p):
      logits = model.apply({"params": policy.cast_to_compute(p)},
                           policy.cast_to_compute(x))
      logits = policy.cast_to_output(logits).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    grads = loss_scale.unscale(grads)
    finite = jmp_lab.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # Skip the step on device (no host sync) if the gradients overflowed.
    params, opt_state = jmp_lab.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale.adjust(finite), loss, finite

  return train_step


def accuracy(model, params, policy, x, y):
  logits = model.apply({"params": policy.cast_to_compute(params)},
                       policy.cast_to_compute(x))
  return float(jnp.mean(jnp.argmax(logits, -1) == y))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", default="mixed_float16")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=128)
  args = parser.parse_args(argv)

  policy = jmp_lab.get_policy(args.policy)
  (x_train, y_train), (x_test, y_test) = load_data()
  model = MLP()
  params = policy.cast_to_param(
      model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"])
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)
  loss_scale = jmp_lab.DynamicLossScale(2.0**15, growth_interval=100)
  train_step = make_train_step(model, tx, policy)

  rng = np.random.default_rng(0)
  skipped = 0
  print(f"policy: {policy}")
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(x_train), args.batch_size)
    params, opt_state, loss_scale, loss, finite = train_step(
        params, opt_state, loss_scale,
        x_train[idx], y_train[idx])
    skipped += int(not finite)
    if step % 100 == 0 or step == args.steps:
      print(f"step {step:4d}  loss {float(loss):.4f}  "
            f"loss scale {float(loss_scale.loss_scale):.0f}  skipped {skipped}")
  acc = accuracy(model, params, policy, x_test, y_test)
  print(f"test accuracy: {acc:.3f}")
  return acc


if __name__ == "__main__":
  main()
