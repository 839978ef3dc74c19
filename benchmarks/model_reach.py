"""Does a policy reach model code as people write it? Matmul precision of
real-model train steps, traced and compiled for an H100, and their loss.

Each model of :mod:`benchmarks.real_models` is trained by a jmp_lab train
step under a policy. Linen models go through ``jmp_lab.linen.with_policy``,
the NNX model through ``jmp_lab.nnx.with_policy``, and the Equinox model
through ``jmp_lab.autocast``. The step is audited in three ways:

* ``audit_step``: the share of matmul and convolution FLOPs with half
  operands in the traced step (forward and backward), and under
  ``matmul=mxfp8``/``nvfp4`` the share block-scaled;
* ``compiled_report`` (with ``--target h100``, no GPU needed): the GEMMs
  and convolutions of the module compiled for an H100 that have an f32
  operand, out of all of them (``--target b200``: also the block-scaled
  GEMMs);
* ``--steps N``: the loss after N steps on real data (digits for the
  ResNet, the standard library's bytes for the LMs), against fp32's (or
  ``--baseline``'s) on the same batches.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/model_reach.py --target h100
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/model_reach.py --steps 200
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/model_reach.py \
      --policy mixed_mxfp8 --target b200 --steps 60 --baseline mixed_bfloat16

The compiled figures are a model of the GPU program, not measurements on a
GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_lab
from jmp_lab import linen as jl
from benchmarks import real_models as rm


@dataclasses.dataclass
class Case:
  """One model under one policy: ``step(state, batch) -> (state, metrics)``
  is pure (jit it, audit it, compile it), ``state`` its first state,
  ``batches`` real data and ``forward(state, batch)`` the loss alone."""

  name: str
  policy: str
  step: Callable[[Any, Any], tuple[Any, dict]]
  state: Any
  batches: Iterator[Any]
  forward: Callable[[Any, Any], Any]


def _linen_case(name, policy, loss_fn, state, batches) -> Case:
  def forward(state, batch):
    out = loss_fn(state.params, state, batch)
    return out[0] if isinstance(out, tuple) else out
  return Case(name, policy, functools.partial(jmp_lab.train_step,
                                              loss_fn=loss_fn),
              state, batches, forward)


def _optimizer(policy: str, learning_rate: float):
  half = jmp_lab.get_policy(policy).compute_dtype != np.dtype(jnp.float32)
  loss_scale = (jmp_lab.DynamicLossScale() if half
                else jmp_lab.NoOpLossScale())
  return jmp_lab.mixed_precision(optax.adamw(learning_rate), policy=policy,
                                 loss_scale=loss_scale)


def _digit_batches(batch: int, seed: int = 0) -> Iterator[Any]:
  images, labels = rm.digits("train")
  rng = np.random.default_rng(seed)
  while True:
    chosen = rng.choice(len(labels), batch, replace=False)
    yield {"x": images[chosen], "y": labels[chosen]}


def _text_batches(batch: int, length: int, seed: int = 0) -> Iterator[Any]:
  return rm.text_batches(rm.stdlib_bytes(), batch, length, seed)


def resnet_case(policy: str, *, batch: int = 32, seed: int = 0,
                **model_kw) -> Case:
  model = jl.with_policy(rm.ResNet(**model_kw), policy)
  variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=variables["params"],
      # batch_stats, and the fp8 scaling state under an fp8 policy.
      model_state={k: v for k, v in variables.items() if k != "params"},
      tx=_optimizer(policy, 3e-3), policy=policy)

  def loss_fn(params, state, batch):
    logits, updates = state.apply_fn(
        {"params": params, **state.model_state}, batch["x"],
        mutable=["batch_stats"])
    loss = jl.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()
    return loss, {"model_state": updates}

  return _linen_case("ResNet (linen, BatchNorm)", policy, loss_fn, state,
                     _digit_batches(batch, seed))


def _lm_loss(logits_fn):
  def loss_fn(params, state, tokens):
    logits = logits_fn(params, state, tokens[:, :-1])
    return jl.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()
  return loss_fn


def linen_lm_case(policy: str, *, batch: int = 8, length: int = 64,
                  seed: int = 0, name: Optional[str] = None,
                  **config_kw) -> Case:
  config = rm.TransformerConfig(max_len=length, **config_kw)
  model = jl.with_policy(rm.TransformerLM(config), policy)
  variables = dict(model.init(jax.random.key(0),
                              jnp.zeros((1, length), jnp.int32)))
  params = variables.pop("params")
  # Under an fp8 policy the rest is the fp8 scaling state.
  state = jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                    model_state=variables,
                                    tx=_optimizer(policy, 3e-3),
                                    policy=policy)
  loss_fn = _lm_loss(lambda params, state, tokens: state.apply_fn(
      {"params": params, **state.model_state}, tokens))
  return _linen_case(name or "Transformer LM (linen)", policy, loss_fn,
                     state, _text_batches(batch, length, seed))


def _plain_lm_case(name: str, module: nn.Module, policy: str, batch: int,
                   length: int, seed: int) -> Case:
  """A linen LM called as ``apply({"params": ...}, tokens)``."""
  model = jl.with_policy(module, policy)
  params = model.init(jax.random.key(0),
                      jnp.zeros((1, length), jnp.int32))["params"]
  state = jmp_lab.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=_optimizer(policy, 3e-3),
                                    policy=policy)
  loss_fn = _lm_loss(lambda params, state, tokens: state.apply_fn(
      {"params": params}, tokens))
  return _linen_case(name, policy, loss_fn, state,
                     _text_batches(batch, length, seed))


def griffin_case(policy: str, *, batch: int = 8, length: int = 64,
                 seed: int = 0, **config_kw) -> Case:
  return _plain_lm_case("Griffin recurrent LM (linen)",
                        rm.GriffinLM(rm.GriffinConfig(**config_kw)), policy,
                        batch, length, seed)


def hf_gpt2_case(policy: str, *, batch: int = 8, length: int = 64,
                 seed: int = 0, **config_kw) -> Case:
  return _plain_lm_case(
      "GPT-2 (Hugging Face's Flax code, linen)",
      rm.HFGPT2LM(rm.GPT2Config(n_positions=length, **config_kw)), policy,
      batch, length, seed)


def gemma_case(policy: str, *, batch: int = 8, length: int = 64,
               seed: int = 0, **config_kw) -> Case:
  config = rm.GemmaConfig(**config_kw)
  model = jmp_lab.nnx.with_policy(rm.GemmaLM(config, rngs=nnx.Rngs(0)),
                                  policy)
  optimizer = jmp_lab.nnx.Optimizer(model, _optimizer(policy, 3e-3),
                                    wrt=nnx.Param)

  def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return jmp_lab.nnx.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  step, state = jmp_lab.nnx.split_train_step(loss_fn, model, optimizer)
  graphdef, _ = nnx.split((model, optimizer))

  def forward(state, tokens):
    model, _ = nnx.merge(graphdef, state)
    return loss_fn(model, tokens)

  return Case("Gemma-style LM (NNX)", policy, step, state,
              _text_batches(batch, length, seed), forward)


def equinox_case(policy: str, *, batch: int = 8, length: int = 64,
                 seed: int = 0, **model_kw) -> Case:
  import equinox as eqx
  model = rm.EqxTransformer(max_len=length, key=jax.random.key(0),
                            **model_kw)
  params, static = eqx.partition(model, eqx.is_array)

  def logits(params, tokens):
    return jax.vmap(eqx.combine(params, static))(tokens)

  state = jmp_lab.TrainState.create(
      apply_fn=jmp_lab.autocast(logits, policy), params=params,
      tx=_optimizer(policy, 3e-3), policy=policy)
  loss_fn = _lm_loss(lambda params, state, tokens: state.apply_fn(params,
                                                                  tokens))
  return _linen_case("Transformer LM (Equinox, autocast)", policy, loss_fn,
                     state, _text_batches(batch, length, seed))


CASES: dict[str, Callable[..., Case]] = {
    "resnet": resnet_case,
    "linen_lm": linen_lm_case,
    "linen_lm_custom": functools.partial(
        linen_lm_case, norm="rmsnorm", attention="custom", scan_layers=True,
        name="Transformer LM (linen; own RMSNorm and attention, nn.scan)"),
    "griffin": griffin_case,
    "hf_gpt2": hf_gpt2_case,
    "gemma": gemma_case,
    "equinox": equinox_case,
}


def audit(case: Case) -> dict[str, Any]:
  batch = next(case.batches)
  report = jmp_lab.diagnostics.audit_step(case.step, case.state, batch,
                                          policy=case.policy)
  return {"half_share": report.half_flop_share,
          "block_scaled_share": report.block_scaled_flop_share,
          "matmuls": len(report.matmuls)}


def compiled(case: Case, target: str) -> dict[str, Any]:
  batch = next(case.batches)
  # Spills are reported, not refused: this counts GEMM dtypes.
  report = jmp_lab.diagnostics.compiled_report(case.step, case.state, batch,
                                               target=target,
                                               fail_on_spill=False)
  f32 = [g for g in report.gemms
         if "f32" in (g.lhs.dtype, g.rhs.dtype)]
  return {"gemms": len(report.gemms), "f32_gemms": len(f32),
          "block_scaled_gemms": sum(g.times
                                    for g in report.block_scaled_gemms)}


def train(case: Case, steps: int, step=None) -> float:
  """The mean training loss over the last quarter of ``steps`` steps (the
  batches are the same for every policy: the data seeds are fixed).
  ``step``: ``jax.jit(case.step)`` already made (and compiled)."""
  step = jax.jit(case.step) if step is None else step
  state, losses = case.state, []
  for _ in range(steps):
    state, metrics = step(state, next(case.batches))
    losses.append(metrics["loss"])
  tail = max(1, steps // 4)
  return float(np.mean(jax.device_get(losses[-tail:])))


def train_on_seeds(make_case: Callable[..., Case], policy: str, steps: int,
                   seeds: int) -> float:
  """:func:`train`'s loss averaged over data seeds ``0 .. seeds - 1``. A
  case's seed chooses its batches only (the model's init is fixed), so one
  model and one compiled step serve every seed: a case made per seed would
  bring a new ``apply_fn`` and compile the step again."""
  case = make_case(policy)
  step = jax.jit(case.step)
  return float(np.mean([
      train(dataclasses.replace(case, batches=make_case(policy, seed=seed)
                                .batches), steps, step)
      for seed in range(seeds)]))


def main(argv=None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", default=",".join(CASES),
                      help="comma-separated: " + ", ".join(CASES))
  parser.add_argument("--policy", default="mixed_bfloat16")
  parser.add_argument("--target", default=None,
                      help="also compile each step for this GPU (h100, h200, b200)")
  parser.add_argument("--steps", type=int, default=0,
                      help="also train this many steps, and the baseline "
                           "beside it")
  parser.add_argument("--baseline", default="float32",
                      help="with --steps: the policy whose loss the ratio "
                           "is taken against")
  parser.add_argument("--seeds", type=int, default=1,
                      help="with --steps: data seeds to average the loss over")
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.cases.split(",") if n.strip()]
  unknown = [n for n in names if n not in CASES]
  if unknown:
    parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
  rows = []
  for name in names:
    case = CASES[name](args.policy)
    row = {"case": name, "model": case.name, **audit(case)}
    if args.target:
      row.update(compiled(case, args.target))
    if args.steps:
      row["loss"], row["baseline_loss"] = (
          train_on_seeds(CASES[name], policy, args.steps, args.seeds)
          for policy in (args.policy, args.baseline))
    rows.append(row)
    print(_row_text(row, args), flush=True)
  print()
  print(table(rows, args))
  return rows


def _row_text(row, args) -> str:
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                  for k, v in row.items())


def table(rows, args) -> str:
  block_scaled = any(row["block_scaled_share"] for row in rows)
  head = f"| model | matmul FLOPs in half (`audit_step`, {args.policy}) |"
  rule = "|---|---|"
  if block_scaled:
    head += " matmul FLOPs block-scaled |"
    rule += "---|"
  if args.target:
    head += f" GEMMs/convolutions with an f32 operand ({args.target}) |"
    rule += "---|"
    if block_scaled:
      head += " block-scaled GEMMs |"
      rule += "---|"
  if args.steps:
    head += (f" loss, last quarter of {args.steps} steps"
             f"{f' (mean of {args.seeds} seeds)' if args.seeds > 1 else ''}"
             f" | {args.baseline} | ratio |")
    rule += "---|---|---|"
  lines = [head, rule]
  for row in rows:
    line = f"| {row['model']} | {100 * row['half_share']:.0f}% |"
    if block_scaled:
      line += f" {100 * row['block_scaled_share']:.0f}% |"
    if args.target:
      line += f" {row['f32_gemms']} of {row['gemms']} |"
      if block_scaled:
        line += f" {row['block_scaled_gemms']} |"
    if args.steps:
      line += (f" {row['loss']:.4f} | {row['baseline_loss']:.4f} | "
               f"{row['loss'] / row['baseline_loss']:.4f} |")
    lines.append(line)
  return "\n".join(lines)


if __name__ == "__main__":
  main()
