"""fp8 quantization: the scales, the quantize step the products share, what
a step observes of a tensor, and the straight-through quantize-dequantize
building blocks (:func:`quantize_operands`, :func:`quantize_output_gradient`)
that compose an fp8 product from any product.

Built on Flax's ``fp8_ops`` (``quantize``, ``dequantize``, ``qdq``): the
pattern XLA's GPU compiler rewrites into a cuBLASLt fp8 GEMM.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jmp_lab._src.numerics.fp8_state import E4M3, E5M2, Fp8Meta, check_meta
from jmp_lab.kernels import rounding
from jmp_lab.kernels.stats import all_finite, part_maxima


def observation(x: jax.Array, scale: jax.Array, amax_history: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """What one step observes of ``x``, as the cotangents of its scale and
  history; ``x``'s amax is the largest value in the two.

  When ``x`` splits into as many equal parts as the history has entries,
  the history slot holds the parts' maxima (zero in the scale slot), and
  :func:`next_meta` finishes the reduction for all tensors at once: XLA
  compiles a reduction of a large tensor to one number into two kernels,
  and the second, a one-block kernel per tensor, was most of what fp8's
  amaxes cost in kernels. Otherwise (a tensor smaller than the history)
  the scale slot holds the amax, and the history slot zeros.
  """
  parts = None if amax_history.ndim != 1 else part_maxima(
      x, amax_history.shape[-1])
  if parts is not None:
    return jnp.zeros_like(scale), parts
  return (jnp.max(jnp.abs(x)).astype(jnp.float32).reshape(jnp.shape(scale)),
          jnp.zeros_like(amax_history))


def _quantize_dequantize(x: jax.Array, q_dtype, scale: jax.Array
                         ) -> jax.Array:
  """Flax's ``fp8_ops.qdq`` with the fp8 tensor behind an optimization
  barrier, so that it is a value of its own in the compiled program.

  XLA then compiles the quantization and ``x``'s amax reduction into one
  kernel (the reduction with the fp8 tensor as a second output), and writes
  the transposed copy that cuBLASLt's fp8 weight-gradient GEMM reads by
  transposing the fp8 bytes. Without the barrier it fuses the cast into
  each transpose instead (two kernels reading the 16-bit tensor) and
  leaves the amax a reduction of its own that reads the tensor once more.
  Compiled for the H100, the barrier on every operand and output gradient,
  with the amaxes split in parts (:func:`observation`), takes fewer bytes
  and fewer kernels on both GPT-2 small's fp8 step and the 1.3B-class lean
  step (``benchmarks/fp8_breakdown.py``; the figures are in
  ``benchmarks/RESULTS.md``). The barrier changes no value.
  """
  return fp8_ops.dequantize(quantize(x, q_dtype, scale), x.dtype, scale)


def quantize(x: jax.Array, q_dtype, scale: jax.Array) -> jax.Array:
  """``x`` as fp8 (Flax's ``fp8_ops.quantize``), behind the optimization
  barrier of :func:`_quantize_dequantize`."""
  return jax.lax.optimization_barrier(
      fp8_ops.quantize(x, q_dtype, scale, x.dtype))


# --- delayed scaling: quantize with the stored scale, observe the amax -------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delayed_in_qdq(q_dtype, x, scale, amax_history):
  del amax_history
  return _quantize_dequantize(x, q_dtype, scale)


def _delayed_in_qdq_fwd(q_dtype, x, scale, amax_history):
  return (_delayed_in_qdq(q_dtype, x, scale, amax_history),
          observation(x, scale, amax_history))


def _delayed_in_qdq_bwd(q_dtype, residuals, g):
  del q_dtype
  # Straight through for x (its gradient is quantized at the output); the
  # state's "gradient" is the observation next_meta reads.
  return (g, *residuals)


_delayed_in_qdq.defvjp(_delayed_in_qdq_fwd, _delayed_in_qdq_bwd)


@jax.custom_vjp
def _delayed_out_qdq(y, scale, amax_history):
  del scale, amax_history
  return y


def _delayed_out_qdq_fwd(y, scale, amax_history):
  return y, (scale, amax_history)


def _delayed_out_qdq_bwd(residuals, g):
  scale, amax_history = residuals
  return (_quantize_dequantize(g, E5M2, scale),
          *observation(g, scale, amax_history))


_delayed_out_qdq.defvjp(_delayed_out_qdq_fwd, _delayed_out_qdq_bwd)


# --- current scaling: the scale of each tensor from its own amax ------------


def _current_qdq(x: jax.Array, fp8_dtype) -> jax.Array:
  """``x`` quantized to ``fp8_dtype`` with the scale of its own amax, and
  dequantized back to its dtype."""
  return fp8_ops.qdq(x, fp8_dtype, current_scale(x, fp8_dtype), x.dtype)


@jax.custom_vjp
def _current_in_qdq(x):
  return _current_qdq(x, E4M3)


def _current_in_qdq_fwd(x):
  return _current_qdq(x, E4M3), None


def _current_in_qdq_bwd(_, g):
  return (g,)  # straight through: the gradient is quantized at the output


_current_in_qdq.defvjp(_current_in_qdq_fwd, _current_in_qdq_bwd)


@jax.custom_vjp
def _current_out_qdq(y):
  return y


def _current_out_qdq_fwd(y):
  return y, None


def _current_out_qdq_bwd(_, g):
  return (_current_qdq(g, E5M2),)


_current_out_qdq.defvjp(_current_out_qdq_fwd, _current_out_qdq_bwd)


# --- the building blocks -----------------------------------------------------


def quantize_operands(lhs: jax.Array, rhs: jax.Array,
                      meta: Optional[Fp8Meta] = None
                      ) -> tuple[jax.Array, jax.Array]:
  """The two operands of an fp8 matmul, quantized to E4M3 and dequantized
  to ``rhs``'s dtype (the compute dtype; ``rhs`` is the kernel): delayed
  scaling with ``meta``, current scaling without."""
  compute = rhs.dtype
  lhs = lhs.astype(compute)
  if meta is None:
    return _current_in_qdq(lhs), _current_in_qdq(rhs)
  check_meta(meta)
  return (_delayed_in_qdq(E4M3, lhs, meta["input_scale"],
                          meta["input_amax_history"]),
          _delayed_in_qdq(E4M3, rhs, meta["kernel_scale"],
                          meta["kernel_amax_history"]))


def quantize_output_gradient(y: jax.Array, meta: Optional[Fp8Meta] = None
                             ) -> jax.Array:
  """``y`` unchanged; its gradient quantized to E5M2 (delayed scaling with
  ``meta``, current scaling without)."""
  if meta is None:
    return _current_out_qdq(y)
  return _delayed_out_qdq(y, meta["output_grad_scale"],
                          meta["output_grad_amax_history"])


def current_scale(x: jax.Array, fp8_dtype) -> jax.Array:
  """Current scaling's scale of ``x``: its amax over the fp8 format's
  largest value (1 for an all-zero ``x``), as a product with its fp32
  reciprocal (:func:`~jmp_lab.kernels.rounding.over_constant`: the same bits
  eagerly and jitted)."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  fp8_max = fp8_ops.get_fp8_max(fp8_dtype, jnp.float32)
  return jax.lax.stop_gradient(jnp.where(
      amax > 0, rounding.over_constant(amax, fp8_max), 1.0))


def observed_finite(observed: Any) -> jax.Array:
  """Whether every amax a step observed (the fp8 state's gradient, or the
  new state) is finite, as one scalar bool: the train steps hand it to the
  optimizer's gate (``also_finite``), which skips the step otherwise.

  fp8 quantization saturates: an inf activation is clipped to the format's
  maximum, so the gradients of a step that overflowed can be finite. Its
  amax, recorded in the history, would then pin that tensor's scale for the
  next ``history_length`` steps: such a step is skipped (and the loss scale
  backs off) like any overflow, and the fp8 state is kept.

  It takes a few reductions for the whole model: a check per leaf would be a
  kernel per history slot of partial maxima, and a reduction of their
  concatenation to one number no better (XLA splits it back into one
  reduction per operand). Reducing the rows of each width's stacked leaves,
  as :func:`next_meta` does, stays one reduction. An amax is never negative,
  so a row's maximum is finite exactly when all its entries are (a NaN
  propagates through the maximum, an inf is the maximum).
  """
  rows_by_width: dict[int, list[jax.Array]] = {}
  for leaf in jax.tree_util.tree_leaves(observed):
    if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      leaf = jnp.asarray(leaf, jnp.float32)
      width = leaf.shape[-1] if leaf.ndim else 1
      rows_by_width.setdefault(width, []).append(leaf.reshape(-1, width))
  maxima = [jnp.max(jnp.concatenate(rows), axis=1)
            for rows in rows_by_width.values()]
  return all_finite([jnp.concatenate(maxima)] if maxima else [])
