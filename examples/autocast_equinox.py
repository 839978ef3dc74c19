"""An Equinox transformer trained in mixed precision with ``jmp_lab.autocast``.

The model is plain Equinox. It is built from ``eqx.nn`` layers with fp32
params, applied per example with ``jax.vmap``, with Equinox's own attention
and softmax. It has no policy code. ``jmp_lab.autocast(logits, policy)``
runs it with torch.autocast's rules:

* every matmul in bf16 (or fp16);
* softmax, LayerNorm's statistics and the loss in fp32;
* everything else in the dtype its inputs arrive in.

``jmp_lab.mixed_precision`` keeps the fp32 params as they are and holds the
loss scale, and ``jmp_lab.make_train_step`` runs the step. The data is the
Python standard library's own sources, read byte by byte: nothing is
downloaded. At the end the step's audit is printed. It is the share of
matmul FLOPs in half precision, which is 100%, against 0% for the same
model without autocast.

  python examples/autocast_equinox.py                    # bf16, 300 steps
  python examples/autocast_equinox.py --policy mixed_float16
  python examples/autocast_equinox.py --policy float32   # the fp32 baseline
  python examples/autocast_equinox.py --policy mixed_mxfp8  # Blackwell's MXFP8

Under ``mixed_mxfp8`` or ``mixed_nvfp4`` every ``Linear`` (a ``weight @ x``)
is block-scaled, as on a B200 (emulated on a CPU); the audit then also
prints the block-scaled share.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jmp_lab
from char_transformer import load_tokens, validation_batch
from common import POLICY_HELP, policy_spec


class Block(eqx.Module):
  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp_in: eqx.nn.Linear
  mlp_out: eqx.nn.Linear

  def __init__(self, width: int, heads: int, *, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.LayerNorm(width)
    self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
    self.norm2 = eqx.nn.LayerNorm(width)
    self.mlp_in = eqx.nn.Linear(width, 4 * width, key=k2)
    self.mlp_out = eqx.nn.Linear(4 * width, width, key=k3)

  def __call__(self, x, mask):
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h, mask=mask)
    h = jax.vmap(self.norm2)(x)
    return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class CharTransformer(eqx.Module):
  """Bytes in, next-byte logits out, for one ``(T,)`` sequence."""

  embedding: eqx.nn.Embedding
  positions: jax.Array
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, width=128, depth=2, heads=4, max_len=128, *, key):
    keys = jax.random.split(key, depth + 3)
    self.embedding = eqx.nn.Embedding(256, width, key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (max_len, width))
    self.blocks = [Block(width, heads, key=k) for k in keys[3:]]
    self.norm = eqx.nn.LayerNorm(width)
    self.head = eqx.nn.Linear(width, 256, key=keys[2])

  def __call__(self, tokens):
    x = jax.vmap(self.embedding)(tokens) + self.positions[:tokens.shape[0]]
    mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
    for block in self.blocks:
      x = block(x, mask)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", default="mixed_bfloat16", type=policy_spec,
                      help=POLICY_HELP)
  parser.add_argument("--steps", type=int, default=300, help="train steps")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=128,
                      help="context length in bytes")
  parser.add_argument("--lr", type=float, default=2e-3, help="learning rate")
  parser.add_argument("--data", default=None,
                      help="a text file (default: the standard library)")
  parser.add_argument("--seed", type=int, default=0,
                      help="the init and batch seed")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar")
  args = parser.parse_args(argv)
  policy = jmp_lab.get_policy(args.policy)

  tokens = load_tokens(args.data)
  cut = int(0.95 * len(tokens))
  train_tokens, valid_tokens = tokens[:cut], tokens[cut:]
  model = CharTransformer(max_len=args.seq_len,
                          key=jax.random.key(args.seed))
  # Equinox's idiom: the arrays are the params, the rest is static.
  params, static = eqx.partition(model, eqx.is_array)

  def logits(params, tokens):
    return jax.vmap(eqx.combine(params, static))(tokens)

  half = policy.compute_dtype != np.dtype(jnp.float32)
  tx = jmp_lab.mixed_precision(
      optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr)),
      policy=policy,
      loss_scale=(jmp_lab.DynamicLossScale(2.0**15, growth_interval=100)
                  if half else jmp_lab.NoOpLossScale()))
  state = jmp_lab.TrainState.create(
      apply_fn=jmp_lab.autocast(logits, policy), params=params, tx=tx,
      policy=policy)

  def loss_fn(params, state, batch):
    out = state.apply_fn(params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        out.astype(jnp.float32), batch[:, 1:]).mean()

  train_step = jmp_lab.make_train_step(loss_fn)
  evaluate = jax.jit(lambda params, batch: loss_fn(params, state, batch))
  rng = np.random.default_rng(args.seed)
  print(f"policy: {policy}; {sum(x.size for x in jax.tree.leaves(params)):,} "
        f"params")
  start, losses = None, []
  recorder = jmp_lab.diagnostics.TrainingRecorder()
  for step in tqdm(range(1, args.steps + 1), disable=args.no_progress):
    starts = rng.integers(0, len(train_tokens) - args.seq_len - 1,
                          args.batch_size)
    batch = np.stack([train_tokens[s:s + args.seq_len + 1] for s in starts])
    state, metrics = train_step(state, batch)
    losses.append(metrics["loss"])
    recorder.record(metrics)  # device arrays: no sync
    if step == 1:
      jax.block_until_ready(metrics["loss"])
      start = time.perf_counter()  # after the compile
  jax.block_until_ready(state.params)
  seconds = time.perf_counter() - start if args.steps > 1 else float("nan")
  valid_loss = float(evaluate(state.params,
                              validation_batch(valid_tokens, args.seq_len)))
  audit = jmp_lab.diagnostics.audit_step(train_step, state, batch,
                                         policy=policy)
  print(recorder.describe())
  print(f"final train loss {float(losses[-1]):.3f}  valid loss "
        f"{valid_loss:.3f} nats/char  loss scale "
        f"{float(metrics['loss_scale']):.0f}  skipped "
        f"{int(metrics['skipped_steps'])}")
  print(f"{(args.steps - 1) * args.batch_size * args.seq_len / seconds:,.0f} "
        f"tokens/s (a CPU figure is not a speed claim)")
  print(f"matmul FLOPs in half precision: {100 * audit.half_flop_share:.0f}%")
  if audit.block_scaled_flop_share:
    print(f"matmul FLOPs block-scaled ({policy.matmul}): "
          f"{100 * audit.block_scaled_flop_share:.0f}%")
  return {"valid_loss": valid_loss, "half_flop_share": audit.half_flop_share,
          "block_scaled_flop_share": audit.block_scaled_flop_share,
          "state": state}


if __name__ == "__main__":
  main()
