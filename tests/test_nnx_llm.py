"""Public-style NNX language models (tests/nnx_llm.py: a Qwen3-style model
with per-head q/k norms and a tied head, a Llama-3-style one with an untied
head and a sliding-window mask) trained under jmp_lab as their own code is
written: built under a mesh with ``nnx.with_partitioning`` annotations,
wrapped by ``jmp_lab.nnx.with_policy``, stepped by
``jmp_lab.nnx.make_train_step``.

On jax 0.12, before the interpreter bound a jaxpr's constants to their own
variables, every step of these models failed: the masks built from integer
positions compared a float with an int ("lax.lt requires arguments to have
the same dtypes, got float32, int32").
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lab
from jmp_lab.diagnostics import audit_step

import nnx_llm

MODELS = {
    "qwen3": nnx_llm.Config(tie_embeddings=True, qk_norm=True),
    "llama3": nnx_llm.Config(tie_embeddings=False, qk_norm=False,
                             sliding_window=6),
}
POLICIES = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8"]


def _model(cfg, policy):
  with jax.set_mesh(nnx_llm.mesh()):
    model = nnx_llm.LLM(cfg, rngs=nnx.Rngs(0))
  return jmp_lab.nnx.with_policy(model, policy)


def _train(name, policy, steps):
  cfg = MODELS[name]
  model = _model(cfg, policy)
  optimizer = jmp_lab.nnx.Optimizer(
      model, jmp_lab.mixed_precision(optax.adamw(3e-3), policy=policy),
      wrt=nnx.Param)
  step = jmp_lab.nnx.make_train_step(nnx_llm.loss_fn)
  data = nnx_llm.batches(cfg)
  return [step(model, optimizer, next(data)) for _ in range(steps)], model


@functools.cache
def _losses(name, policy, steps=12):
  metrics, _ = _train(name, policy, steps)
  return np.array([float(m["loss"]) for m in metrics
                   if bool(m["grads_finite"])])


@pytest.mark.floor_lane
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_under_every_policy_as_fp32_does(name, policy):
  losses, want = _losses(name, policy), _losses(name, "float32")
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0]
  # Half precision follows the fp32 run's curve (fp16's first steps may be
  # skipped while its loss scale comes down; fp8's E4M3 forward and E5M2
  # gradients round most).
  tolerance = 0.1 if policy == "mixed_fp8" else 0.05
  assert abs(losses[-1] - want[-1]) < tolerance * want[-1], (losses, want)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_matmul_flop_of_the_step_is_bf16(name):
  cfg = MODELS[name]
  model = _model(cfg, "mixed_bfloat16")
  optimizer = jmp_lab.nnx.Optimizer(
      model, jmp_lab.mixed_precision(optax.adamw(1e-3),
                                     policy="mixed_bfloat16"), wrt=nnx.Param)
  step, state = jmp_lab.nnx.split_train_step(nnx_llm.loss_fn, model,
                                              optimizer)
  tokens = next(nnx_llm.batches(cfg))
  report = audit_step(step, state, tokens, policy="mixed_bfloat16")
  assert report.half_flop_share == 1.0, report.table()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_under_the_policy_matches_the_unwrapped_model(name):
  cfg = MODELS[name]
  tokens = next(nnx_llm.batches(cfg))[:, :-1]
  with jax.set_mesh(nnx_llm.mesh()):
    plain = nnx_llm.LLM(cfg, rngs=nnx.Rngs(0))
  want = plain(tokens)
  got = _model(cfg, "mixed_bfloat16")(tokens)
  chex.assert_type(got, jnp.float32)
  chex.assert_trees_all_close(got, want, atol=0.1, rtol=0.05)
