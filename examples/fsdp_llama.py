"""A Llama-style model trained FSDP x tensor parallel, as MaxText shards it.

The model names the logical axes of every param and activation
(``nn.with_logical_partitioning``, ``nn.with_logical_constraint``); a list of
logical axis rules maps them to a mesh of (data, fsdp, tensor) axes. The
state is created boxed under ``jax.jit`` with the shardings
:func:`jmp_lab.sharding.state_shardings` derives from those rules (the fp32
master and the moments follow their params; ZeRO-1 over ``data`` on top),
unboxed, and trained with :func:`jmp_lab.make_train_step`, which keeps the
layout step after step. The text is the Python standard library's sources,
as bytes.

``--devices 8`` makes this machine's CPU into 8 devices, so the run works
anywhere:

  python examples/fsdp_llama.py --mesh data=2,fsdp=2,tensor=2
  python examples/fsdp_llama.py --mesh fsdp=4,tensor=2 --optimizer fused_adamw
  python examples/fsdp_llama.py --mesh fsdp=8 --compare  # and on one device

``--compare`` runs the same steps on one device too and prints the largest
difference of the params. ``--out FILE`` writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import Optional

# The device count must be set before jax starts (see main).
if __name__ == "__main__" and "--devices" in sys.argv:
  _count = sys.argv[sys.argv.index("--devices") + 1]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_count}")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jmp_lab  # noqa: E402
from common import POLICY_HELP, policy_spec, stdlib_text  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-style decoder. The defaults are a small model for a CPU; the
  7B-class one is :data:`LLAMA_7B`."""

  vocab: int = 256
  width: int = 128
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  mlp: int = 344
  seq_len: int = 64
  scan: bool = False      # the layers under nn.scan (one compiled body)
  remat: bool = False     # recompute each layer in the backward pass
  #: with remat, what the backward pass recomputes: "full", everything;
  #: "selective", all but the weight GEMMs' outputs (MaxText's "minimal").
  remat_policy: str = "full"
  mesh: Optional[Mesh] = None  # where the activations' logical axes apply


#: Llama-2-7B's shapes, with grouped-query attention (32 query, 8 KV heads):
#: 5.9B params at a 32k vocabulary.
LLAMA_7B = LlamaConfig(vocab=32000, width=4096, layers=32, heads=32,
                       kv_heads=8, mlp=11008, seq_len=4096, scan=True,
                       remat=True)

#: Logical axes to mesh axes, as MaxText's defaults: the batch over every
#: data-like axis, each weight's model dimension over ``fsdp``, its heads or
#: hidden units over ``tensor``.
RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("length", None),
    ("layers", None),
)


def rules_for(mesh: Mesh) -> tuple:
  """:data:`RULES` without the axes ``mesh`` does not have."""
  def keep(target):
    if target is None or isinstance(target, str):
      return target if target in mesh.axis_names else None
    kept = tuple(a for a in target if a in mesh.axis_names)
    return kept or None
  return tuple((name, keep(target)) for name, target in RULES)


def _partitioned(init, names):
  return nn.with_logical_partitioning(init, names)


def _constrain(x, names, config: LlamaConfig):
  """``x`` laid out by its logical axes on the config's mesh (the rules
  come from ``nn.logical_axis_rules``). The mesh is passed, not set as a
  context: under ``jax.set_mesh`` Flax would also constrain DenseGeneral's
  flattened kernel by its 3-D names when it checks a param's shape."""
  if config.mesh is None:
    return x
  return nn.with_logical_constraint(x, names, mesh=config.mesh)


_normal = nn.initializers.normal(0.02)


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "selective": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _rope(x: jax.Array) -> jax.Array:
  """Rotary position embedding of ``(batch, length, heads, dim)``."""
  length, dim = x.shape[1], x.shape[-1]
  freqs = 1.0 / (10000 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * freqs[None, :]
  sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
  cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
  even, odd = x[..., 0::2], x[..., 1::2]
  return jnp.stack([even * cos - odd * sin, even * sin + odd * cos],
                   axis=-1).reshape(x.shape)


class Attention(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    head_dim = c.width // c.heads

    def project(heads, name, names):
      return nn.DenseGeneral((heads, head_dim), use_bias=False, name=name,
                             kernel_init=_partitioned(_normal, names))(x)

    q = project(c.heads, "query", ("embed", "heads", "kv"))
    k = project(c.kv_heads, "key", ("embed", "kv_heads", "kv"))
    v = project(c.kv_heads, "value", ("embed", "kv_heads", "kv"))
    q = _constrain(_rope(q), ("batch", "length", "heads", "kv"), c)
    k = _constrain(_rope(k), ("batch", "length", "kv_heads", "kv"), c)
    v = _constrain(v, ("batch", "length", "kv_heads", "kv"), c)
    out = jmp_lab.attention.dot_product_attention(q, k, v, causal=True)
    out = _constrain(out, ("batch", "length", "heads", "kv"), c)
    return nn.DenseGeneral(c.width, axis=(-2, -1), use_bias=False,
                           name="out", kernel_init=_partitioned(
                               _normal, ("heads", "kv", "embed")))(out)


class MLP(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(nn.Dense, self.config.mlp, use_bias=False,
                              kernel_init=_partitioned(_normal,
                                                       ("embed", "mlp")))
    hidden = nn.silu(dense(name="gate")(x)) * dense(name="up")(x)
    hidden = _constrain(hidden, ("batch", "length", "mlp"), self.config)
    return nn.Dense(self.config.width, use_bias=False, name="down",
                    kernel_init=_partitioned(_normal, ("mlp", "embed")))(hidden)


def _norm(name: str) -> nn.RMSNorm:
  return nn.RMSNorm(name=name, scale_init=_partitioned(nn.initializers.ones,
                                                       ("embed",)))


class Block(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, _=None):
    x = x + Attention(self.config)(_norm("attention_norm")(x))
    x = x + MLP(self.config)(_norm("mlp_norm")(x))
    x = _constrain(x, ("batch", "length", "embed"), self.config)
    return (x, None) if self.config.scan else x


class Llama(nn.Module):
  """Token ids ``(batch, length)`` to the final hidden states."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x = nn.Embed(c.vocab, c.width, embedding_init=_partitioned(
        _normal, ("vocab", "embed")))(tokens)
    x = _constrain(x, ("batch", "length", "embed"), c)
    block = Block
    if c.remat:
      block = nn.remat(block, prevent_cse=not c.scan,
                       policy=_REMAT_POLICIES[c.remat_policy])
    if c.scan:
      # fp8 policies keep each layer's scaling state in their own
      # collection: stacked per layer, as the params are.
      x, _ = nn.scan(block, variable_axes={"params": 0,
                                           jmp_lab.fp8.COLLECTION: 0},
                     split_rngs={"params": True}, length=c.layers,
                     metadata_params={nn.PARTITION_NAME: "layers"})(
                         c, name="layers")(x, None)
    else:
      for i in range(c.layers):
        x = block(c, name=f"layer_{i}")(x)
    return _norm("final_norm")(x)


class LlamaLM(nn.Module):
  """The model and its head: ``(hidden, head kernel)``, so that the loss can
  be :func:`jmp_lab.losses.linear_cross_entropy` (no logits stored)."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens):
    hidden = Llama(self.config, name="model")(tokens)
    head = self.param("head", _partitioned(_normal, ("embed", "vocab")),
                      (self.config.width, self.config.vocab))
    return hidden, head


def loss_fn(params, state, batch, *, vocab_shards: int = 1):
  """Next-token cross-entropy, the head's logits never stored.

  ``vocab_shards``: the tensor axis's size, over which the head's vocabulary
  is split; the loss then sums the hidden state's gradient across those
  devices once a step, not once per vocabulary block."""
  hidden, head = state.apply_fn({"params": params, **state.model_state},
                                batch[:, :-1])
  return jmp_lab.losses.linear_cross_entropy(
      hidden, head, batch[:, 1:], vocab_shards=vocab_shards).mean()


def make_optimizer(name: str, policy: str, lr: float):
  scale = (jmp_lab.DynamicLossScale(2.0**15)
           if jmp_lab.get_policy(policy).compute_dtype == jnp.float16
           else jmp_lab.NoOpLossScale())
  if name == "mixed_precision":
    return jmp_lab.mixed_precision(optax.adamw(lr), policy=policy,
                                   loss_scale=scale)
  return jmp_lab.fused_adamw(lr, policy=policy, loss_scale=scale)


def sharded_state(model, config: LlamaConfig, tx, policy: str, mesh: Mesh,
                  batch_size: int):
  """MaxText's flow: the state created boxed under ``jit`` with the
  shardings its logical axes ask for, then unboxed. Returns ``(state,
  layout)``."""
  tokens = jnp.zeros((batch_size, config.seq_len), jnp.int32)

  def init(key):
    variables = dict(model.init(key, tokens))
    params = variables.pop("params")
    # model_state: an fp8 policy's scaling state (empty otherwise)
    return jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                     tx=tx, policy=policy,
                                     model_state=variables)

  zero1 = "data" if "data" in mesh.axis_names else None
  rules = rules_for(mesh)
  abstract = jax.eval_shape(init, jax.random.key(0))
  layout = jmp_lab.sharding.state_shardings(
      abstract, mesh, zero1, shard_optimizer_state=zero1 is not None,
      rules=rules)
  # No mesh context here: out_shardings lay the state out, and Flax's
  # DenseGeneral would constrain its flattened kernel with the 3-D names.
  with nn.logical_axis_rules(rules):
    state = jax.jit(init, out_shardings=layout)(jax.random.key(0))
  return nn.unbox(state), layout


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, steps: int):
  rng = np.random.default_rng(0)
  for _ in range(steps):
    starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
    yield np.stack([tokens[s:s + seq_len + 1] for s in starts])


def parse_mesh(text: str) -> dict[str, int]:
  axes = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if name not in ("data", "fsdp", "tensor") or not size.isdigit():
      raise argparse.ArgumentTypeError(
          f"--mesh takes data=N,fsdp=N,tensor=N (any of them), got {text!r}")
    axes[name] = int(size)
  return axes


def train(args) -> dict:
  axes = args.mesh
  count = int(np.prod(list(axes.values())))
  if jax.device_count() < count:
    raise SystemExit(f"the mesh {axes} needs {count} devices, jax has "
                     f"{jax.device_count()}: pass --devices {count}")
  mesh = Mesh(np.array(jax.devices()[:count]).reshape(tuple(axes.values())),
              tuple(axes))
  config = LlamaConfig(seq_len=args.seq_len, mesh=mesh)
  model = jmp_lab.linen.with_policy(LlamaLM(config), args.policy)
  tx = make_optimizer(args.optimizer, args.policy, args.lr)
  state, layout = sharded_state(model, config, tx, args.policy, mesh,
                                args.batch)
  rules = rules_for(mesh)
  batch_axes = dict(rules)["batch"]
  step = jmp_lab.make_train_step(
      functools.partial(loss_fn, vocab_shards=mesh.shape.get("tensor", 1)),
      state_sharding=layout,
      batch_sharding=NamedSharding(mesh, P(batch_axes)))
  data = np.frombuffer(stdlib_text(), np.uint8).astype(np.int32)
  losses = []
  with nn.logical_axis_rules(rules):
    for batch in batches(data, args.batch, args.seq_len, args.steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  print(f"mesh {axes}, {args.optimizer}, {args.policy}: loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
  kernel = jax.tree_util.tree_leaves(state.params)[0]
  print(f"a param's sharding: {kernel.sharding.spec}; optimizer state per "
        f"device {jmp_lab.sharding.bytes_per_device(state.opt_state) / 2**20:.2f}"
        f" MiB")
  result = {"losses": losses}
  if args.compare:
    result["max_param_difference"] = _compare(args, config, state, data)
  return result


def _compare(args, config, sharded, data) -> float:
  """The same steps on one device; the largest difference of the params."""
  config = dataclasses.replace(config, mesh=None)
  model = jmp_lab.linen.with_policy(LlamaLM(config), args.policy)
  tokens = jnp.zeros((args.batch, config.seq_len), jnp.int32)
  variables = dict(nn.unbox(model.init(jax.random.key(0), tokens)))
  params = variables.pop("params")
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params, policy=args.policy,
      model_state=variables,
      tx=make_optimizer(args.optimizer, args.policy, args.lr))
  step = jmp_lab.make_train_step(loss_fn)
  for batch in batches(data, args.batch, args.seq_len, args.steps):
    state, _ = step(state, batch)
  difference = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) -
                                         b.astype(jnp.float32))))
                   for a, b in zip(jax.tree_util.tree_leaves(sharded.params),
                                   jax.tree_util.tree_leaves(state.params)))
  print(f"one device: largest param difference {difference:.2e}")
  return difference


def main(argv: Optional[list[str]] = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=None,
                      help="CPU devices to make (before jax starts)")
  parser.add_argument("--mesh", type=parse_mesh,
                      default=parse_mesh("data=2,fsdp=2,tensor=2"))
  parser.add_argument("--optimizer", default="mixed_precision",
                      choices=["mixed_precision", "fused_adamw"])
  parser.add_argument("--policy", type=policy_spec,
                      default="p=bf16,c=bf16,o=f32,reduce=float32",
                      help=POLICY_HELP)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--compare", action="store_true")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  result = train(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f)
  return result


if __name__ == "__main__":
  main()
