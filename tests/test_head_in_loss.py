"""Warnings that are true: a head computed in the loss function.

Public NNX LLM code computes the head in the loss (``model(x,
skip_lm_head=True)``, then the tied embedding's transpose, an untied head's
kernel, or a chunked head under ``nnx.remat`` in ``lax.scan``). With the
model wrapped by ``with_policy`` those matmuls are recast to half by the
loss's rules and every GEMM runs in bf16, yet the train step warned that
"the model's matmuls are written in fp32 and run outside any model policy
... wrap the model", which was wrapped. The warning now fires only when the
model's matmuls really run outside a policy: an unwrapped model.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lab
from jmp_lab.precision import PrecisionWarning

VOCAB, WIDTH = 64, 32


class TinyLM(nnx.Module):
  def __init__(self, rngs, tied: bool):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.block = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.head = None if tied else nnx.Linear(WIDTH, VOCAB, use_bias=False,
                                             rngs=rngs)

  def __call__(self, tokens, skip_lm_head: bool = False):
    h = self.norm(self.embed(tokens) + jax.nn.gelu(self.block(
        self.embed(tokens))))
    if skip_lm_head:
      return h
    return h @ self.head_weight()

  def head_weight(self):
    """``(WIDTH, VOCAB)``: the tied table's transpose or the head's kernel."""
    return (self.embed.embedding[...].T if self.head is None
            else self.head.kernel[...])


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def head_in_loss(model, batch):
  h = model(batch[:, :-1], skip_lm_head=True)
  return _xent(h @ model.head_weight(), batch[:, 1:])


def chunked_head_in_loss(model, batch):
  """The head over chunks of tokens, each under ``nnx.remat``, in a scan."""
  h = model(batch[:, :-1], skip_lm_head=True).reshape(-1, 4, WIDTH)
  labels = batch[:, 1:].reshape(-1, 4)

  weight = model.head_weight()

  @nnx.remat
  def chunk(h_chunk, label_chunk, weight):
    return _xent(h_chunk @ weight, label_chunk)

  def body(total, xs):
    return total + chunk(*xs, weight), None
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (h, labels))
  return total / h.shape[0]


LOSSES = {"tied": (True, head_in_loss), "untied": (False, head_in_loss),
          "chunked-remat-scan": (False, chunked_head_in_loss)}
BATCH = np.random.default_rng(0).integers(0, VOCAB, (4, 9))


def _step_warnings(tied, loss_fn, wrapped, policy="mixed_bfloat16"):
  model = TinyLM(nnx.Rngs(0), tied)
  if wrapped:
    model = jmp_lab.nnx.with_policy(model, policy)
  optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
      optax.adamw(1e-3), policy=policy), wrt=nnx.Param)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    metrics = jmp_lab.nnx.train_step(model, optimizer, BATCH,
                                     loss_fn=loss_fn)
  assert np.isfinite(float(metrics["loss"]))
  return [w for w in caught if issubclass(w.category, PrecisionWarning)]


@pytest.mark.parametrize("pattern", LOSSES)
def test_a_wrapped_model_with_its_head_in_the_loss_gets_no_warning(pattern):
  """Every GEMM of it runs in bf16 (the audit: 100%), so nothing warns."""
  tied, loss_fn = LOSSES[pattern]
  assert _step_warnings(tied, loss_fn, wrapped=True) == []
  model = jmp_lab.nnx.with_policy(TinyLM(nnx.Rngs(0), tied), "mixed_bfloat16")
  optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
      optax.adamw(1e-3), policy="mixed_bfloat16"), wrt=nnx.Param)
  step, state = jmp_lab.nnx.split_train_step(loss_fn, model, optimizer)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    audit = jmp_lab.diagnostics.audit_step(step, state, BATCH)
  assert audit.half_flop_share == 1.0


@pytest.mark.parametrize("pattern", LOSSES)
def test_an_unwrapped_model_with_its_head_in_the_loss_still_warns(pattern):
  """The model's own matmuls run outside any policy: only the loss's rules
  put them in half, its norms and everything else stay fp32. True, and
  said once."""
  tied, loss_fn = LOSSES[pattern]
  caught = _step_warnings(tied, loss_fn, wrapped=False)
  assert len(caught) == 1
  assert "outside any model policy" in str(caught[0].message)
  assert "wrap the model" in str(caught[0].message)
