"""fp8 matmuls with per-tensor scaling, for Hopper's fp8 tensor cores.

A policy with ``matmul="fp8"`` (the ``"mixed_fp8"`` preset) or
``"fp8_current"`` runs the Dense/Linear (and Einsum) matmuls of
:func:`jmp_lab.linen.with_policy` and :func:`jmp_lab.nnx.with_policy` through
:func:`dot_general` (:func:`einsum`): the inputs
and kernels are quantized to E4M3 and the output gradient to E5M2, each
divided by its own scale. The matmul itself is written as
quantize-dequantize around a ``dot_general`` in the compute dtype; XLA's GPU
compiler rewrites that pattern into one fp8 cuBLASLt GEMM with the scales
folded in (forward, input gradient and weight gradient alike), and on a CPU
the same program emulates it. It is built on Flax's ``fp8_ops`` (``in_qdq``
and ``out_qdq``, the functions behind ``Fp8DotGeneralOp``) rather than
``jax.nn.scaled_dot_general``, which takes per-block scales (MX formats,
Blackwell) rather than Hopper's per-tensor ones.

**Scaling.** Transformer Engine's scale is ``fp8_max / amax``; the stored
``*_scale`` here is its reciprocal, ``amax / fp8_max`` (what a value is
multiplied by after quantization), as in Flax's ``fp8_ops``:

* ``"fp8"`` -- delayed scaling (TE's default): each tensor is scaled by
  ``max(amax_history) / fp8_max`` computed from *earlier* steps, and the
  step then appends its own amax (history length 1,024 by default). The
  state is a :data:`Fp8Meta` dict per matmul: three scales and three
  histories.
* ``"fp8_current"`` -- current scaling: each tensor is scaled by its own
  amax, computed just before quantizing (one more read of it); no state.

**The state is overwrite-with-gradient.** The delayed-scaling state's
"gradient" (what ``jax.grad`` returns for it) *is* its new value, so it never
reaches the optimizer: linen keeps it in the ``_overwrite_with_gradient``
collection (:data:`COLLECTION`, Flax's name) of ``TrainState.model_state``,
NNX in :class:`Fp8Meta` variables, and both train steps differentiate it
and overwrite it. On a skipped (non-finite) step it keeps its old value,
like every other state: an inf recorded in an amax history would pin that
tensor's scale for the next 1,024 steps. Since quantizing saturates (an inf
activation becomes the format's maximum, and the gradients can stay
finite), a step whose new amax is not finite is skipped too
(:func:`skip_unless_finite`).

Example::

  >>> import jax, jax.numpy as jnp
  >>> from jmp_lab import fp8
  >>> meta = fp8.init_meta(history_length=4)
  >>> x, w = jnp.full((16, 32), 3.0, jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
  >>> y, new_meta = fp8.value_and_new_meta(
  ...     lambda m: fp8.dot_general(x, w, (((1,), (0,)), ((), ())), meta=m).sum(), meta)
  >>> float(new_meta["input_amax_history"][0])   # this step's amax of x
  3.0
  >>> float(new_meta["input_scale"][0]) == 1.0   # scaled from the (empty) history
  True
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jmp_lab.loss_scale import all_finite

E4M3 = jnp.float8_e4m3fn  # inputs and kernels
E5M2 = jnp.float8_e5m2    # output gradients
AMAX_HISTORY_LENGTH = 1024
COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT

Fp8Meta = dict  # {input,kernel,output_grad}_{scale,amax_history}: f32 arrays
_TENSORS = ("input", "kernel", "output_grad")


def init_meta(history_length: int = AMAX_HISTORY_LENGTH) -> Fp8Meta:
  """The delayed-scaling state of one matmul: scales 1, histories 0."""
  if not isinstance(history_length, int) or history_length < 1:
    raise ValueError(f"history_length must be a positive int, got "
                     f"{history_length!r}")
  meta = {}
  for tensor in _TENSORS:
    meta[f"{tensor}_scale"] = jnp.ones((1,), jnp.float32)
    meta[f"{tensor}_amax_history"] = jnp.zeros((history_length,), jnp.float32)
  return meta


def _check_meta(meta: Any) -> None:
  expected = {f"{t}_{k}" for t in _TENSORS for k in ("scale", "amax_history")}
  if not isinstance(meta, dict) or set(meta) != expected:
    raise TypeError(
        f"fp8 meta must be the dict jmp_lab.fp8.init_meta() returns, with "
        f"keys {sorted(expected)}; got "
        f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}")


def delayed_scale(amax_history: jax.Array, scale: jax.Array,
                  fp8_dtype) -> jax.Array:
  """The stored scale (``amax / fp8_max``) a delayed-scaled tensor uses:
  from the largest amax of the history, the old scale while that is zero or
  not finite (Flax's ``fp8_ops.compute_scale``)."""
  fp8_max = fp8_ops.get_fp8_max(fp8_dtype, jnp.float32)
  return fp8_ops.compute_scale(jnp.max(amax_history, axis=0), scale, fp8_max)


# --- current scaling: the scale of each tensor from its own amax ------------


def _current_qdq(x: jax.Array, fp8_dtype) -> jax.Array:
  """``x`` quantized to ``fp8_dtype`` with the scale of its own amax, and
  dequantized back to its dtype."""
  fp8_max = fp8_ops.get_fp8_max(fp8_dtype, jnp.float32)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / fp8_max, 1.0).reshape((1,))
  return fp8_ops.qdq(x, fp8_dtype, jax.lax.stop_gradient(scale), x.dtype)


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


# --- the matmul ----------------------------------------------------------------


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
  _check_meta(meta)
  return (fp8_ops.in_qdq(compute, E4M3, lhs, meta["input_scale"],
                         meta["input_amax_history"]),
          fp8_ops.in_qdq(compute, E4M3, rhs, meta["kernel_scale"],
                         meta["kernel_amax_history"]))


def quantize_output_gradient(y: jax.Array, meta: Optional[Fp8Meta] = None
                             ) -> jax.Array:
  """``y`` unchanged; its gradient quantized to E5M2 (delayed scaling with
  ``meta``, current scaling without)."""
  if meta is None:
    return _current_out_qdq(y)
  return fp8_ops.out_qdq(y.dtype, E5M2, y, meta["output_grad_scale"],
                         meta["output_grad_amax_history"])


def _fp8_product(product: Callable[[jax.Array, jax.Array], jax.Array],
                 lhs: jax.Array, rhs: jax.Array, meta: Optional[Fp8Meta],
                 out_sharding) -> jax.Array:
  """``product(lhs, rhs)`` (a matmul or einsum of the two) with E4M3
  operands and an E5M2 output gradient; ``rhs`` is the kernel."""
  if out_sharding is not None:
    raise ValueError(f"an fp8 matmul does not take out_sharding (got "
                     f"{out_sharding!r})")
  return quantize_output_gradient(
      product(*quantize_operands(lhs, rhs, meta)), meta)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                precision=None, preferred_element_type=None, *,
                meta: Optional[Fp8Meta] = None, out_sharding=None
                ) -> jax.Array:
  """``lax.dot_general`` as an fp8 GEMM: E4M3 operands, E5M2 gradient.

  ``rhs`` is the kernel; ``lhs`` is cast to its dtype (the compute dtype),
  in which the result is returned. With ``meta`` (:func:`init_meta`) the
  scaling is delayed, and the gradient with respect to ``meta`` is the
  updated meta (overwrite-with-gradient); without, it is current scaling.
  ``precision`` and ``preferred_element_type`` are not used: an fp8 GEMM
  accumulates in fp32 and returns the compute dtype.
  """
  del precision, preferred_element_type
  return _fp8_product(
      lambda a, b: jax.lax.dot_general(a, b, dimension_numbers),
      lhs, rhs, meta, out_sharding)


def einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, precision=None,
           preferred_element_type=None, *, meta: Optional[Fp8Meta] = None,
           out_sharding=None) -> jax.Array:
  """``jnp.einsum(subscripts, lhs, rhs)`` as an fp8 GEMM, as
  :func:`dot_general` (``rhs`` is the kernel): flax NNX's ``Einsum``
  (``einsum_op``) and linen's ``Einsum`` under an fp8 policy.

  >>> import jax.numpy as jnp
  >>> x, w = jnp.full((2, 3, 4), 3.0, jnp.bfloat16), jnp.ones((4, 5), jnp.bfloat16)
  >>> y = einsum("btd,dk->btk", x, w)   # current scaling: 3.0 is exact
  >>> y.dtype, float(y[0, 0, 0])
  (dtype(bfloat16), 12.0)
  """
  del precision, preferred_element_type
  return _fp8_product(lambda a, b: jnp.einsum(subscripts, a, b), lhs, rhs,
                      meta, out_sharding)


def current_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, out_sharding=None):
  """:func:`dot_general` with current scaling: the signature of
  ``lax.dot_general``, for a layer's ``dot_general`` attribute."""
  return dot_general(lhs, rhs, dimension_numbers, precision,
                     preferred_element_type, out_sharding=out_sharding)


def current_einsum(subscripts, lhs, rhs, precision=None,
                   preferred_element_type=None, out_sharding=None):
  """:func:`einsum` with current scaling, for an NNX ``Einsum``'s
  ``einsum_op``."""
  return einsum(subscripts, lhs, rhs, precision, preferred_element_type,
                out_sharding=out_sharding)


def delayed_dot_general(meta: Fp8Meta) -> Callable[..., jax.Array]:
  """:func:`dot_general` with delayed scaling from ``meta``, with the
  signature of ``lax.dot_general``."""

  def fn(lhs, rhs, dimension_numbers, precision=None,
         preferred_element_type=None, out_sharding=None):
    return dot_general(lhs, rhs, dimension_numbers, precision,
                       preferred_element_type, meta=meta,
                       out_sharding=out_sharding)

  return fn


def delayed_einsum(meta: Fp8Meta) -> Callable[..., jax.Array]:
  """:func:`einsum` with delayed scaling from ``meta``, with the signature
  of an NNX ``Einsum``'s ``einsum_op``."""

  def fn(subscripts, lhs, rhs, precision=None, preferred_element_type=None,
         out_sharding=None):
    return einsum(subscripts, lhs, rhs, precision, preferred_element_type,
                  meta=meta, out_sharding=out_sharding)

  return fn


def value_and_new_meta(fun: Callable[[Fp8Meta], jax.Array], meta: Fp8Meta
                       ) -> tuple[jax.Array, Fp8Meta]:
  """``(fun(meta), the meta after one step)``: the overwrite-with-gradient
  rule, for a function with one delayed-scaled matmul (a step's meta is the
  gradient with respect to it)."""
  return jax.value_and_grad(fun)(meta)


def skip_unless_finite(grads: Any, new_meta: Any) -> Any:
  """``grads``, with a NaN in one leaf when a new scale or amax is not finite.

  fp8 quantization saturates: an inf activation is clipped to the format's
  maximum, so the gradients of a step that overflowed can be finite. Its
  amax, recorded in the history, would then pin that tensor's scale for the
  next ``history_length`` steps. The train steps therefore hand the
  optimizer a NaN for such a step: it is skipped (and the loss scale backs
  off) like any overflow, and the fp8 state is kept. One leaf is enough for
  the optimizer's finite check, and touching one leaf keeps XLA's fusions of
  the others as they are.
  """
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  floating = [i for i, g in enumerate(leaves)
              if jnp.issubdtype(jnp.result_type(g), jnp.floating)]
  if not floating:
    return grads
  smallest = min(floating, key=lambda i: jnp.size(leaves[i]))
  poison = jnp.where(all_finite(new_meta), 0.0, jnp.nan)
  leaves[smallest] = leaves[smallest] + poison.astype(leaves[smallest].dtype)
  return treedef.unflatten(leaves)


__all__ = ["AMAX_HISTORY_LENGTH", "COLLECTION", "E4M3", "E5M2", "Fp8Meta",
           "current_dot_general", "delayed_dot_general", "delayed_scale",
           "dot_general", "init_meta", "skip_unless_finite",
           "value_and_new_meta"]
