"""The character-level transformer of ``char_transformer.py``, in Flax NNX.

Same data (the standard library's own sources, or ``--data FILE``), same
model, same optimizers; the NNX version of the training loop. Converting an
NNX loop to mixed precision is one policy line and one optimizer line::

  model = jmp_lab.nnx.with_policy(CharTransformer(...), "mixed_bfloat16")
  optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
      optax.adamw(...), policy="mixed_bfloat16",
      loss_scale=jmp_lab.DynamicLossScale()), wrt=nnx.Param)

and the step is ``jmp_lab.nnx.make_train_step(loss_fn)(model, optimizer,
batch)``. Checkpoints are orbax saves of ``nnx.state((model, optimizer))``.

  python examples/char_transformer_nnx.py --steps 300
  python examples/char_transformer_nnx.py --policy mixed_float16 --fused
  python examples/char_transformer_nnx.py --steps 100 --resume
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

import jmp_lab
from char_transformer import (bf16_layers, checked_run_config, load_tokens,
                              make_optimizer, make_parser, validation_batch)


class Block(nnx.Module):
  def __init__(self, width: int, heads: int, dropout: float, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)  # fp32 by jmp_lab's default
    # Causal attention with its fp32 softmax in a fused kernel on a GPU (no
    # mask, no attention dropout: no fused kernel has either).
    self.attn = nnx.MultiHeadAttention(
        heads, width, decode=False, rngs=rngs,
        attention_fn=functools.partial(jmp_lab.nnx.dot_product_attention,
                                       causal=True))
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x):
    h = self.norm1(x)
    x = x + self.attn(h)
    h = self.down(nnx.gelu(self.up(self.norm2(x))))
    return x + self.dropout(h)


class CharTransformer(nnx.Module):
  def __init__(self, *, vocab: int = 256, width: int = 128, depth: int = 2,
               heads: int = 4, max_len: int = 128, dropout: float = 0.1,
               rngs: nnx.Rngs):
    self.tokens = nnx.Embed(vocab, width, rngs=rngs)
    self.positions = nnx.Embed(max_len, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, dropout, rngs)
                            for _ in range(depth)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Param(nnx.initializers.lecun_normal()(
        rngs.params(), (width, vocab)))

  def __call__(self, tokens, targets=None):
    """The logits, or with ``targets`` the loss of each position."""
    x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    x = self.norm(x)
    if targets is None:
      return x @ self.head[...]
    # fp32 cross-entropy over vocabulary blocks: the logits never stored.
    return jmp_lab.losses.linear_cross_entropy(x, self.head[...], targets)


def loss_fn(model, batch):
  return model(batch[:, :-1], targets=batch[:, 1:]).mean()


@nnx.jit
def valid_loss_of(model, batch):
  model = nnx.view(model, deterministic=True)
  return loss_fn(model, batch)


def sample(model, prompt: bytes, length: int, max_len: int, key) -> bytes:
  """Generates ``length`` bytes after ``prompt`` (temperature 0.8)."""
  model = nnx.view(model, deterministic=True)
  tokens = list(prompt)

  @nnx.jit
  def next_token(model, context, last, key):
    logits = model(context)[0, last]
    return jax.random.categorical(key, logits.astype(jnp.float32) / 0.8)

  for i in range(length):
    window = tokens[-max_len:]
    context = np.zeros((1, max_len), np.int32)
    context[0, :len(window)] = window
    tokens.append(int(next_token(model, jnp.asarray(context), len(window) - 1,
                                 jax.random.fold_in(key, i))))
  return bytes(tokens[len(prompt):])


def main(argv=None):
  parser = make_parser(__doc__.splitlines()[0], "char_nnx_ckpt")
  args = parser.parse_args(argv)

  policy = jmp_lab.get_policy(args.policy)
  tokens = load_tokens(args.data)
  split = int(0.95 * len(tokens))
  train_tokens, valid_tokens = tokens[:split], tokens[split:]
  # The two lines that make an NNX loop mixed precision:
  model = jmp_lab.nnx.with_policy(
      CharTransformer(max_len=args.seq_len,
                      rngs=nnx.Rngs(args.seed, dropout=args.seed + 1)), policy,
      path_overrides=bf16_layers(args))
  optimizer = jmp_lab.nnx.Optimizer(model, make_optimizer(args, policy),
                                    wrt=nnx.Param)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(
      nnx.state(model, nnx.Param)))
  print(f"{len(tokens):,} bytes of text; {n_params:,} params; policy {policy}; "
        f"optimizer {'fused_adamw' if args.fused else 'mixed_precision(adamw)'}"
        f", master {args.master} (Flax NNX)")

  ckpt_dir = os.path.abspath(args.ckpt_dir)
  manager = ocp.CheckpointManager(
      ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  start_step = 0
  resuming = args.resume and manager.latest_step() is not None
  checked_run_config(args, policy, resuming)
  if resuming:
    start_step = manager.latest_step()
    restored = manager.restore(start_step, args=ocp.args.StandardRestore(
        nnx.state((model, optimizer))))
    nnx.update((model, optimizer), restored)
    print(f"resumed from step {start_step} (loss scale "
          f"{float(optimizer.loss_scale.loss_scale):g}, "
          f"{int(optimizer.skipped_steps)} skipped so far)")

  step_fn = jmp_lab.nnx.make_train_step(loss_fn)
  window = args.seq_len + 1
  valid = jnp.asarray(validation_batch(valid_tokens, args.seq_len))
  rng = np.random.default_rng(start_step)  # the linen example's batches
  train_losses = []
  recorder = jmp_lab.diagnostics.TrainingRecorder()
  bar = tqdm(range(start_step, start_step + args.steps), disable=args.no_progress)
  metrics, timed_from, timed_steps = None, None, 0
  for step in bar:
    starts = rng.integers(0, len(train_tokens) - window, args.batch_size)
    batch = jnp.asarray(np.stack([train_tokens[s:s + window] for s in starts]))
    metrics = step_fn(model, optimizer, batch)
    train_losses.append(metrics["loss"])  # a device array: no sync
    recorder.record(metrics)
    if timed_from is None:  # exclude compilation from tokens/s
      jax.block_until_ready(metrics)
      timed_from = time.perf_counter()
    else:
      timed_steps += 1
    if (step + 1) % 20 == 0:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                      scale=f"{float(metrics['loss_scale']):g}")
    if (step + 1) % args.ckpt_every == 0:
      manager.save(step + 1, args=ocp.args.StandardSave(
          nnx.state((model, optimizer))))
  jax.block_until_ready(metrics)
  seconds = time.perf_counter() - timed_from
  final_step = start_step + args.steps
  if manager.latest_step() != final_step:
    manager.save(final_step, args=ocp.args.StandardSave(
        nnx.state((model, optimizer))), force=True)
  manager.wait_until_finished()

  valid_loss = float(valid_loss_of(model, valid))
  tokens_per_s = timed_steps * args.batch_size * args.seq_len / max(seconds, 1e-9)
  print(f"step {final_step}: train loss {float(metrics['loss']):.3f}, valid loss "
        f"{valid_loss:.3f} nats/char, loss scale "
        f"{float(optimizer.loss_scale.loss_scale):g}, skipped "
        f"{int(optimizer.skipped_steps)}, {tokens_per_s:,.0f} tokens/s")
  print(f"this run: {recorder.describe()}")
  text = sample(model, b"def ", args.sample_len, args.seq_len, jax.random.key(7))
  print("--- sample ---")
  print("def " + text.decode("utf-8", errors="replace"))
  return {"step": final_step, "valid_loss": valid_loss,
          "tokens_per_s": tokens_per_s, "model": model, "optimizer": optimizer,
          "train_losses": np.asarray(jax.device_get(train_losses), np.float64)}


if __name__ == "__main__":
  main()
