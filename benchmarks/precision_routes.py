"""One policy, one program, whatever the route: jmp_lab.precision measured.

Three comparisons, each printed as a table:

* ``gpt2``: GPT-2 small (12 x 768, T 1024, batch 8; benchmarks/train_step.py's
  model) under ``mixed_bfloat16`` by ``jmp_lab.linen.with_policy(model)`` and
  by ``jmp_lab.autocast(model.apply)``, and under ``float32``, compiled for an
  H100: GEMMs with an f32 operand, args+temp and bytes per step, as ratios.
* ``loss``: the same model returning its hidden states (the policy's fp32
  output), its loss ``jmp_lab.losses.linear_cross_entropy(hidden,
  params["head"], labels)`` written in ``loss_fn``, against the bf16 step and
  the README's recipe (the loss inside the model), compiled for an H100.
* ``elementwise``: the share, by element count, of the forward's
  elementwise results computed in the compute dtype outside the fp32
  islands, for an Equinox decoder and a pure-JAX Llama-style decoder (RMSNorm,
  rotary, SwiGLU, grouped-query attention) under ``jmp_lab.autocast``.

It uses only APIs that predate the one engine, so it runs on the commit
before it too (the before figures in benchmarks/RESULTS.md):

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/precision_routes.py
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/precision_routes.py --only elementwise

Compiled figures are a model of the H100 program, not measurements on one.
"""

from __future__ import annotations

import argparse
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lab
from jmp_lab import linen as jl
from benchmarks import real_models as rm
from benchmarks import train_step as ts

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "abs", "tanh", "logistic",
    "integer_pow", "square", "sqrt", "select_n", "erf", "sin", "cos", "exp",
    "log", "rsqrt", "log1p", "expm1", "pow"})
# The ops an fp32 island is made of (jmp_lab.precision.FP32_OPS).
FP32_OPS = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "pow", "rsqrt", "tan", "asin",
    "acos", "sinh", "cosh", "erf_inv", "reduce_sum", "reduce_prod", "cumsum",
    "cumprod", "cumlogsumexp"})
MATMULS = frozenset({"dot_general", "conv_general_dilated"})


# ---- GPT-2 small by route ----------------------------------------------------


class GPTHidden(nn.Module):
  """GPT-2 small's lean body (cuDNN's attention on CUDA) returning its final
  hidden states: the head is applied in the loss."""

  size: ts.ModelSize

  @nn.compact
  def __call__(self, tokens):
    s = self.size
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = nn.Embed(s.vocab, s.width)(tokens) + nn.Embed(s.seq_len, s.width)(
        positions)
    for _ in range(s.layers):
      x = ts.Block(s.heads, True)(x, None)
    return nn.LayerNorm()(x)


def _state(apply_fn, params, policy):
  tx = jmp_lab.mixed_precision(optax.adamw(3e-4, weight_decay=0.1),
                               policy=policy)
  return jmp_lab.TrainState.create(apply_fn=apply_fn, params=params, tx=tx,
                                   policy=policy)


def _compile(loss_fn, make_state, size):
  state = jax.eval_shape(make_state)
  batch = jax.ShapeDtypeStruct((size.batch, size.seq_len + 1), jnp.int32)
  return jmp_lab.diagnostics.compiled_report(
      jmp_lab.make_train_step(loss_fn), state, batch, target="h100")


def _init(module, size):
  return jax.jit(module.init)(jax.random.key(0),
                              jnp.zeros((1, size.seq_len), jnp.int32))


def gpt2_route(route: str, size: ts.ModelSize):
  """The compiled step of GPT-2 small by ``route``: ``"with_policy"``,
  ``"autocast"`` (mixed_bfloat16) or ``"float32"``."""
  policy = "float32" if route == "float32" else "mixed_bfloat16"

  def make_state():
    if route == "autocast":
      module = ts.GPT(size)
      return _state(jmp_lab.autocast(module.apply, policy),
                    _init(module, size)["params"], policy)
    model = jl.with_policy(ts.GPT(size), policy)
    return _state(model.apply, _init(model, size)["params"], policy)

  return _compile(ts.loss_fn, make_state, size)


def loss_in_loss_fn(size: ts.ModelSize):
  """GPT-2 small whose loss_fn applies linear_cross_entropy to the model's
  fp32 output."""
  policy = "mixed_bfloat16"
  model = jl.with_policy(GPTHidden(size), policy)

  def make_state():
    params = {"model": _init(model, size)["params"],
              "head": jax.random.normal(jax.random.key(1),
                                        (size.width, size.vocab)) * 0.02}
    return _state(model.apply, params, policy)

  def loss_fn(params, state, batch):
    hidden = state.apply_fn({"params": params["model"]}, batch[:, :-1])
    return jmp_lab.losses.linear_cross_entropy(
        hidden, params["head"], batch[:, 1:]).mean()

  return _compile(loss_fn, make_state, size)


def _memory(report) -> int:
  return report.memory["argument"] + report.memory["temp"]


def gpt2_table(size: ts.ModelSize) -> str:
  reports = {route: gpt2_route(route, size)
             for route in ("with_policy", "autocast", "float32")}
  lines = ["| route | GEMMs with an f32 operand | args+temp GiB | x fp32 | "
           "x with_policy | GB/step |", "|---|---|---|---|---|---|"]
  for route, report in reports.items():
    lines.append(
        f"| {route} | {len(report.fp32_gemms)} of {len(report.gemms)} | "
        f"{_memory(report) / 2**30:.2f} | "
        f"{_memory(report) / _memory(reports['float32']):.3f} | "
        f"{_memory(report) / _memory(reports['with_policy']):.3f} | "
        f"{report.bytes_accessed / 1e9:.2f} |")
  return "\n".join(lines)


def loss_table(size: ts.ModelSize) -> str:
  bf16 = ts.compiled_step_report(
      next(c for c in ts.ALL_CONFIGS if c.name == "bf16"), size, "h100")
  inside = ts.compiled_step_report(
      next(c for c in ts.ALL_CONFIGS if c.name == "bf16-lean"), size, "h100")
  written = loss_in_loss_fn(size)
  lines = ["| step | GEMMs with an f32 operand | GB/step | x bf16 step |",
           "|---|---|---|---|"]
  for name, report in (("bf16 (logits stored)", bf16),
                       ("loss inside the model (README recipe)", inside),
                       ("linear_cross_entropy in loss_fn", written)):
    lines.append(f"| {name} | {len(report.fp32_gemms)} | "
                 f"{report.bytes_accessed / 1e9:.2f} | "
                 f"{report.bytes_accessed / bf16.bytes_accessed:.3f} |")
  return "\n".join(lines)


# ---- elementwise share under autocast ------------------------------------------


def _all_eqns(jaxpr):
  from jmp_lab.diagnostics.audit import compiled_sub_jaxprs
  for eqn in jaxpr.eqns:
    yield eqn
    for inner in compiled_sub_jaxprs(eqn):
      yield from _all_eqns(getattr(inner, "jaxpr", inner))


def _vars(atoms) -> list:
  from jax.extend import core as jex_core
  return [v for v in atoms if not isinstance(v, jex_core.Literal)]


def _islands(jaxpr) -> set:
  """The variables of an fp32 island: fp32 ops' results and what is computed
  elementwise from them (until a matmul), and what only feeds them."""
  island, uses = set(), {}
  eqns = list(_all_eqns(jaxpr))
  for eqn in eqns:
    for v in _vars(eqn.invars):
      uses.setdefault(v, []).append(eqn)
  for eqn in eqns:
    name = eqn.primitive.name
    if name in FP32_OPS or (name not in MATMULS and any(
        v in island for v in _vars(eqn.invars))):
      island.update(eqn.outvars)

  def feeds_only_islands(v) -> bool:
    users = uses.get(v, [])
    return bool(users) and all(u.primitive.name in FP32_OPS
                               or set(u.outvars) <= island for u in users)

  for eqn in reversed(eqns):  # what only feeds an island is one too
    if eqn.primitive.name in ELEMENTWISE and all(
        feeds_only_islands(v) for v in eqn.outvars):
      island.update(eqn.outvars)
  return island


def half_elementwise_share(fn: Callable, *args) -> tuple[float, float]:
  """``(share in half outside islands, share in half overall)`` of the
  elementwise results of ``fn``'s traced program, by element count."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  island = _islands(jaxpr)
  counts = {"half": 0, "outside": 0, "all_half": 0, "all": 0}
  for eqn in _all_eqns(jaxpr):
    if eqn.primitive.name not in ELEMENTWISE:
      continue
    for v in eqn.outvars:
      if not jnp.issubdtype(v.aval.dtype, jnp.floating):
        continue
      size = int(np.prod(v.aval.shape))
      half = v.aval.dtype.itemsize == 2
      counts["all"] += size
      counts["all_half"] += size * half
      if v not in island:
        counts["outside"] += size
        counts["half"] += size * half
  return (counts["half"] / max(counts["outside"], 1),
          counts["all_half"] / max(counts["all"], 1))


def llama_params(key, vocab=256, dim=64, layers=2, heads=8, kv_heads=2,
                 hidden=172):
  keys = iter(jax.random.split(key, 4 + 7 * layers))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape)  # noqa: E731
  head_dim = dim // heads
  return {
      "embed": normal((vocab, dim)),
      "layers": [{
          "attn_norm": jnp.ones(dim), "mlp_norm": jnp.ones(dim),
          "wq": normal((dim, heads * head_dim)),
          "wk": normal((dim, kv_heads * head_dim)),
          "wv": normal((dim, kv_heads * head_dim)),
          "wo": normal((heads * head_dim, dim)),
          "w_gate": normal((dim, hidden)), "w_up": normal((dim, hidden)),
          "w_down": normal((hidden, dim))} for _ in range(layers)],
      "norm": jnp.ones(dim), "head": normal((dim, vocab))}


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _rotary(x, positions):
  half = x.shape[-1] // 2
  freqs = 10000.0 ** (-jnp.arange(0, half, dtype=jnp.float32) / half)
  angles = positions[:, None].astype(jnp.float32) * freqs
  sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def llama(params, tokens, heads=8, kv_heads=2):
  """A pure-JAX Llama-style decoder over one (T,) sequence."""
  x = params["embed"][tokens]
  length, dim = x.shape
  head_dim = dim // heads
  positions = jnp.arange(length)
  mask = jnp.tril(jnp.ones((length, length), bool))
  for p in params["layers"]:
    h = _rms_norm(x, p["attn_norm"])
    q = _rotary((h @ p["wq"]).reshape(length, heads, head_dim), positions)
    k = _rotary((h @ p["wk"]).reshape(length, kv_heads, head_dim), positions)
    v = (h @ p["wv"]).reshape(length, kv_heads, head_dim)
    k, v = (jnp.repeat(t, heads // kv_heads, axis=1) for t in (k, v))
    scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim)
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    out = jnp.einsum("hqk,khd->qhd", weights, v).reshape(length, dim)
    x = x + out @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"])
    x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
  return _rms_norm(x, params["norm"]) @ params["head"]


def elementwise_table(policy: str = "mixed_bfloat16") -> str:
  import equinox as eqx
  tokens = jnp.asarray(rm.stdlib_bytes(4096)[:8 * 64].reshape(8, 64),
                       jnp.int32)
  model = rm.EqxTransformer(max_len=64, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  eqx_fn = jmp_lab.autocast(
      lambda p, t: jax.vmap(eqx.combine(p, static))(t), policy)
  llama_fn = jmp_lab.autocast(jax.vmap(llama, in_axes=(None, 0)), policy)
  rows = [("Equinox decoder (benchmarks/real_models.py)", eqx_fn, params),
          ("pure-JAX Llama-style decoder", llama_fn,
           llama_params(jax.random.key(0)))]
  lines = ["| model under autocast | half, outside fp32 islands | "
           "half, all elementwise |", "|---|---|---|"]
  for name, fn, p in rows:
    outside, overall = half_elementwise_share(fn, p, tokens)
    lines.append(f"| {name} | {outside:.1%} | {overall:.1%} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", default="gpt2,loss,elementwise")
  parser.add_argument("--layers", type=int, default=12)
  args = parser.parse_args(argv)
  size = ts.ModelSize(layers=args.layers)
  parts = {"gpt2": lambda: gpt2_table(size), "loss": lambda: loss_table(size),
           "elementwise": elementwise_table}
  for name in args.only.split(","):
    print(f"\n{name}:\n{parts[name.strip()]()}", flush=True)


if __name__ == "__main__":
  main()
