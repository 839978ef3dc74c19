"""A small decoder-only, character-level transformer, in mixed precision.

The default data is text every machine has: the Python standard library's own
sources (``--data FILE`` trains on any text file instead). Nothing is
downloaded. The example shows:

* bf16, fp16 and fp8 (``mixed_fp8``) policies, with LayerNorm and the
  attention softmax in fp32;
* the lean step: causal attention as a fused kernel on a GPU
  (``functools.partial(jl.dot_product_attention, causal=True)``, no mask)
  and the loss by ``jmp_lab.losses.linear_cross_entropy``, which never
  stores the logits;
* gradient clipping on *unscaled* gradients (``--clip``);
* the fused optimizer (``--fused``), or ``mixed_precision(optax.chain(...))``;
* memory-lean masters (``--master remainder|none``, ``--rounding``,
  ``--mu-dtype``, and ``--nu-dtype`` with ``--fused``) with bf16 params
  (``--policy p=bf16,c=bf16,o=f32``);
* orbax checkpointing (``--ckpt-dir``) and ``--resume``;
* tokens/s, and a sample of generated text at the end; under quantized
  matmuls (fp8, mxfp8, nvfp4) also the trained weights' validation loss
  with bf16 matmuls (how well the format trained them).

  python examples/char_transformer.py --steps 300
  python examples/char_transformer.py --policy mixed_float16 --fused
  python examples/char_transformer.py --policy mixed_fp8      # fp8 matmuls
  python examples/char_transformer.py --steps 100 --resume   # continues
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

import jmp_lab
from common import POLICY_HELP, policy_spec, stdlib_text
from jmp_lab import linen as jl


def load_tokens(path: str | None) -> np.ndarray:
  """Bytes as tokens (vocabulary 256): character-level for ASCII text."""
  if path is None:
    data = stdlib_text()
  else:
    with open(path, "rb") as f:
      data = f.read()
  if len(data) < 1024:
    raise ValueError(f"--data needs at least 1024 bytes of text, got {len(data)}")
  return np.frombuffer(data, np.uint8).astype(np.int32)


class Block(nn.Module):
  heads: int
  dropout: float

  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.LayerNorm()(x)  # fp32 by jmp_lab's default
    # Causal attention with its fp32 softmax in a fused kernel on a GPU (no
    # mask, no attention dropout: no fused kernel has either).
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.heads, attention_fn=functools.partial(
            jl.dot_product_attention, causal=True))(h, h)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * x.shape[-1])(h)
    h = nn.Dense(x.shape[-1])(nn.gelu(h))
    return x + nn.Dropout(self.dropout, deterministic=not train)(h)


# The model's size as main()'s flags (the NNX example has its own model).
MODEL_SIZE_FLAGS = ("width", "depth", "heads")

# Block-quantized 8-bit moments (jmp_lab.kernels.quantized).
EIGHT_BIT = ("int8", "float8_e4m3fn")


class CharTransformer(nn.Module):
  vocab: int = 256
  width: int = 128
  depth: int = 2
  heads: int = 4
  max_len: int = 128
  dropout: float = 0.1

  @nn.compact
  def __call__(self, tokens, train: bool = False, targets=None):
    """The logits, or with ``targets`` the loss of each position."""
    positions = jnp.arange(tokens.shape[1])
    x = nn.Embed(self.vocab, self.width)(tokens) + nn.Embed(
        self.max_len, self.width)(positions)
    for _ in range(self.depth):
      x = Block(self.heads, self.dropout)(x, train)
    x = nn.LayerNorm()(x)
    head = self.param("head", nn.initializers.lecun_normal(),
                      (self.width, self.vocab))
    if targets is None:
      return x @ head
    # fp32 cross-entropy over vocabulary blocks: the logits never stored.
    return jmp_lab.losses.linear_cross_entropy(x, head, targets)


def loss_fn(params, state, batch):
  # model_state holds the fp8 scaling state under an fp8 policy (else {}).
  return state.apply_fn({"params": params, **state.model_state},
                        batch["tokens"][:, :-1], train=True,
                        targets=batch["tokens"][:, 1:],
                        rngs={"dropout": batch["rng"]}).mean()


def make_optimizer(args, policy):
  # "auto": a dynamic scale for fp16 compute, none for bf16 and fp32 (bf16
  # has fp32's exponent range, so its gradients do not underflow).
  dynamic = args.loss_scale == "dynamic" or (
      args.loss_scale == "auto" and policy.compute_dtype == jnp.float16)
  loss_scale = (jmp_lab.DynamicLossScale(2.0**15, growth_interval=100)
                if dynamic else jmp_lab.NoOpLossScale())
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, max(args.steps, 100))
  if args.fused:
    # Clipping happens inside the fused kernel, on unscaled gradients.
    return jmp_lab.fused_adamw(schedule, weight_decay=0.01, policy=policy,
                               loss_scale=loss_scale, max_grad_norm=args.clip,
                               master=args.master, rounding=args.rounding,
                               mu_dtype=args.mu_dtype, nu_dtype=args.nu_dtype)
  eight_bit = {args.mu_dtype, args.nu_dtype} & set(EIGHT_BIT)
  if eight_bit:
    # 8-bit moments for optax chains: jmp_lab's quantized AdamW.
    adamw = jmp_lab.optimizer.quantized_adamw(
        schedule, weight_decay=0.01, mu_dtype=args.mu_dtype or "int8",
        nu_dtype=args.nu_dtype or "int8")
  elif args.nu_dtype:
    raise ValueError(
        f"--nu-dtype {args.nu_dtype} needs --fused or an 8-bit dtype: "
        f"optax.adamw has a mu_dtype but no nu_dtype (optax issue 1552)")
  else:
    adamw = optax.adamw(schedule, weight_decay=0.01, mu_dtype=args.mu_dtype)
  # The wrapper unscales first, so clip_by_global_norm sees true gradients.
  return jmp_lab.mixed_precision(
      optax.chain(optax.clip_by_global_norm(args.clip), adamw),
      policy=policy, loss_scale=loss_scale, master=args.master,
      rounding=args.rounding)


def sample(model, variables, prompt: bytes, length: int, max_len: int,
           key) -> bytes:
  """Generates ``length`` bytes after ``prompt`` (temperature 0.8)."""
  tokens = list(prompt)

  @jax.jit
  def next_token(context, last, key):
    # Causal attention: the logits at the last real position ignore the
    # padding after it, so one fixed-size context serves every step.
    logits = model.apply(variables, context)[0, last]
    return jax.random.categorical(key, logits.astype(jnp.float32) / 0.8)

  for i in range(length):
    window = tokens[-max_len:]
    context = np.zeros((1, max_len), np.int32)
    context[0, :len(window)] = window
    token = next_token(jnp.asarray(context), len(window) - 1,
                       jax.random.fold_in(key, i))
    tokens.append(int(token))
  return bytes(tokens[len(prompt):])


def bf16_layers(args) -> dict:
  """``--bf16-layers`` as ``with_policy``'s path overrides."""
  return {args.bf16_layers: "mixed_bfloat16"} if args.bf16_layers else {}


def make_parser(description: str, ckpt_dir: str) -> argparse.ArgumentParser:
  """The options of this example, which the NNX one shares."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--data", default=None,
                      help="a text file (default: the stdlib's own sources)")
  parser.add_argument("--policy", default="mixed_bfloat16", type=policy_spec,
                      help=POLICY_HELP)
  parser.add_argument("--bf16-layers", default=None, metavar="REGEX",
                      help="layers whose path matches keep mixed_bfloat16 "
                           "(a path override), e.g. the last block under "
                           "mixed_nvfp4, as NVIDIA's NVFP4 recipe keeps its "
                           "last blocks: Block_1 here, blocks/1 in the NNX "
                           "example")
  parser.add_argument("--loss-scale", default="auto",
                      choices=["auto", "dynamic", "none"],
                      help="auto: dynamic for fp16 compute, none for bf16 and "
                           "fp32; dynamic (torch GradScaler's rules); none")
  parser.add_argument("--fused", action="store_true", help="use jmp_lab.fused_adamw")
  parser.add_argument("--clip", type=float, default=1.0, help="global-norm clip")
  parser.add_argument("--master", default="float32",
                      choices=["float32", "remainder", "none"],
                      help="how the fp32 master is kept (bf16 params for "
                           "remainder/none: --policy p=bf16,c=bf16,o=f32)")
  parser.add_argument("--rounding", default="nearest",
                      choices=["nearest", "stochastic"],
                      help="rounding of the params with --master none")
  parser.add_argument("--mu-dtype", default=None,
                      choices=["bfloat16", *EIGHT_BIT],
                      help="dtype of Adam's first moment (8-bit: block-"
                      "quantized)")
  parser.add_argument("--nu-dtype", default=None,
                      choices=["bfloat16", *EIGHT_BIT],
                      help="dtype of Adam's second moment (bfloat16: --fused "
                      "only)")
  parser.add_argument("--steps", type=int, default=300,
                      help="steps to train in this run; with --resume, steps "
                           "after the checkpoint's (a resumed run of 100 "
                           "from step 300 ends at step 400)")
  parser.add_argument("--batch-size", type=int, default=32,
                      help="sequences per step")
  parser.add_argument("--seq-len", type=int, default=128,
                      help="context length in bytes")
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="peak learning rate (warmup, cosine decay)")
  parser.add_argument("--seed", type=int, default=0,
                      help="init seed (dropout uses seed + 1)")
  parser.add_argument("--ckpt-dir",
                      default=os.path.join("examples", "out", ckpt_dir),
                      help="where orbax keeps the last two checkpoints")
  parser.add_argument("--ckpt-every", type=int, default=100,
                      help="steps between checkpoints (and one at the end)")
  parser.add_argument("--resume", action="store_true",
                      help="continue from the latest checkpoint in "
                           "--ckpt-dir, for --steps more steps (the options a "
                           "checkpoint depends on must match)")
  parser.add_argument("--sample-len", type=int, default=300,
                      help="bytes of text to generate at the end (0: none)")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar")
  return parser


def checked_run_config(args, policy, resuming: bool) -> dict:
  """The options a checkpoint depends on, written beside the checkpoints;
  resuming with other options is refused by name."""
  config = {"policy": str(policy), "fused": args.fused, "seq_len": args.seq_len,
            "loss_scale": args.loss_scale, "master": args.master,
            "rounding": args.rounding, "mu_dtype": args.mu_dtype,
            "nu_dtype": args.nu_dtype}
  if args.bf16_layers:  # (only when set: older checkpoints still resume)
    config["bf16_layers"] = args.bf16_layers
  for flag in MODEL_SIZE_FLAGS:  # (likewise only when not the default)
    if getattr(args, flag, None) not in (None, getattr(CharTransformer, flag)):
      config[flag] = getattr(args, flag)
  path = os.path.join(os.path.abspath(args.ckpt_dir), "run_config.json")
  if resuming and os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    if saved != config:
      raise ValueError(
          f"--resume: the checkpoints in {args.ckpt_dir} were written with "
          f"{saved}, but this run uses {config}; resume with the same options "
          f"or use another --ckpt-dir")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(config, f)
  return config


def validation_batch(valid_tokens: np.ndarray, seq_len: int,
                     windows: int = 16) -> np.ndarray:
  """``windows`` fixed windows of the held-out text (inputs and next tokens).

  The first 16 are the same for any ``windows``; more of them make the
  validation loss a steadier figure to compare runs by."""
  window = seq_len + 1
  starts = np.random.default_rng(123).integers(0, len(valid_tokens) - window,
                                               windows)
  return np.stack([valid_tokens[s:s + window] for s in starts])


def build_model(args, policy, path_overrides=None) -> nn.Module:
  """The model of ``--width``/``--depth``/``--heads`` under ``policy``."""
  return jl.with_policy(
      CharTransformer(width=args.width, depth=args.depth, heads=args.heads,
                      max_len=args.seq_len), policy,
      path_overrides=path_overrides)


def held_out_loss(model, valid: np.ndarray):
  """A jitted function of ``model``'s variables: its mean loss on ``valid``
  (windows of inputs and next tokens)."""
  return jax.jit(lambda variables: model.apply(
      variables, valid[:, :-1], targets=valid[:, 1:]).mean())


def main(argv=None):
  parser = make_parser(__doc__.splitlines()[0], "char_ckpt")
  parser.add_argument("--eval-every", type=int, default=0,
                      help="also record the validation loss every N steps "
                           "(returned as valid_curve; 0: at the end only)")
  parser.add_argument("--valid-windows", type=int, default=16,
                      help="held-out windows of --seq-len bytes the "
                           "validation loss averages over")
  parser.add_argument("--width", type=int, default=CharTransformer.width,
                      help="model width (a multiple of --heads)")
  parser.add_argument("--depth", type=int, default=CharTransformer.depth,
                      help="transformer blocks")
  parser.add_argument("--heads", type=int, default=CharTransformer.heads,
                      help="attention heads")
  args = parser.parse_args(argv)
  if args.valid_windows < 1:
    parser.error(f"--valid-windows must be at least 1, got {args.valid_windows}")
  for flag in MODEL_SIZE_FLAGS:
    if getattr(args, flag) < 1:
      parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
  if args.width % args.heads:
    parser.error(f"--width {args.width} must be a multiple of --heads "
                 f"{args.heads}")

  policy = jmp_lab.get_policy(args.policy)
  tokens = load_tokens(args.data)
  split = int(0.95 * len(tokens))
  train_tokens, valid_tokens = tokens[:split], tokens[split:]
  model = build_model(args, policy, path_overrides=bf16_layers(args))
  variables = model.init(jax.random.key(args.seed),
                         jnp.zeros((1, args.seq_len), jnp.int32))
  params = variables["params"]
  # Under --policy mixed_fp8 the fp8 scaling state (a collection of its own,
  # overwritten by every step, never seen by the optimizer) rides along.
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params, tx=make_optimizer(args, policy),
      policy=policy,
      model_state={k: v for k, v in variables.items() if k != "params"})
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f"{len(tokens):,} bytes of text; {n_params:,} params; policy {policy}; "
        f"optimizer {'fused_adamw' if args.fused else 'mixed_precision(adamw)'}"
        f", master {args.master}")

  manager = ocp.CheckpointManager(
      os.path.abspath(args.ckpt_dir),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  start_step = 0
  resuming = args.resume and manager.latest_step() is not None
  checked_run_config(args, policy, resuming)
  if resuming:
    start_step = manager.latest_step()
    state = manager.restore(start_step, args=ocp.args.StandardRestore(state))
    print(f"resumed from step {start_step} (loss scale "
          f"{float(state.loss_scale.loss_scale):g}, "
          f"{int(state.skipped_steps)} skipped so far)")

  step_fn = jmp_lab.make_train_step(loss_fn)
  window = args.seq_len + 1  # inputs and the next token
  valid = validation_batch(valid_tokens, args.seq_len, args.valid_windows)
  loss_on_valid = held_out_loss(model, valid)

  def valid_loss_of(state):
    return loss_on_valid({"params": state.params, **state.model_state})

  train_losses, valid_curve = [], []
  recorder = jmp_lab.diagnostics.TrainingRecorder()
  rng = np.random.default_rng(start_step)  # a resumed run draws new batches
  bar = tqdm(range(start_step, start_step + args.steps), disable=args.no_progress)
  metrics, timed_from, timed_steps = None, None, 0
  for step in bar:
    starts = rng.integers(0, len(train_tokens) - window, args.batch_size)
    batch = {"tokens": np.stack([train_tokens[s:s + window] for s in starts]),
             "rng": jax.random.fold_in(jax.random.key(args.seed + 1), step)}
    state, metrics = step_fn(state, batch)
    train_losses.append(metrics["loss"])  # a device array: no sync
    recorder.record(metrics)
    if args.eval_every and (step + 1) % args.eval_every == 0:
      valid_curve.append((step + 1, valid_loss_of(state)))
    if timed_from is None:  # exclude compilation from tokens/s
      jax.block_until_ready(metrics)
      timed_from = time.perf_counter()
    else:
      timed_steps += 1
    if (step + 1) % 20 == 0:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                      scale=f"{float(metrics['loss_scale']):g}")
    if (step + 1) % args.ckpt_every == 0:
      manager.save(step + 1, args=ocp.args.StandardSave(state))
  jax.block_until_ready(state)
  seconds = time.perf_counter() - timed_from
  final_step = start_step + args.steps
  if manager.latest_step() != final_step:
    manager.save(final_step, args=ocp.args.StandardSave(state), force=True)
  manager.wait_until_finished()

  valid_loss = float(valid_loss_of(state))
  # Under quantized matmuls (fp8, mxfp8, nvfp4) the figure above includes
  # the forward's own quantization; the same weights with bf16 matmuls say
  # how well the format trained them, apart from how it runs them.
  valid_loss_bf16 = valid_loss
  if policy.matmul is not None:
    bf16_model = build_model(args, "mixed_bfloat16")
    valid_loss_bf16 = float(held_out_loss(bf16_model, valid)(
        {"params": state.params}))
  tokens_per_s = timed_steps * args.batch_size * args.seq_len / max(seconds, 1e-9)
  print(f"step {final_step}: train loss {float(metrics['loss']):.3f}, valid loss "
        f"{valid_loss:.3f} nats/char, skipped {int(state.skipped_steps)}, "
        f"{tokens_per_s:,.0f} tokens/s")
  if policy.matmul is not None:
    print(f"the same weights with bf16 matmuls: valid loss "
          f"{valid_loss_bf16:.3f} nats/char")
  print(f"this run: {recorder.describe()}")
  text = sample(model, {"params": state.params, **state.model_state}, b"def ",
                args.sample_len, args.seq_len, jax.random.key(7))
  print("--- sample ---")
  print("def " + text.decode("utf-8", errors="replace"))
  return {"step": final_step, "valid_loss": valid_loss,
          "valid_loss_bf16": valid_loss_bf16,
          "tokens_per_s": tokens_per_s, "state": state,
          "train_losses": np.asarray(jax.device_get(train_losses), np.float64),
          "valid_curve": [(s, float(v)) for s, v in valid_curve]}


if __name__ == "__main__":
  main()
