"""fp8 matmuls: the products of Dense layers and of einsums, delayed and
current scaling (the face :mod:`jmp_lab.fp8` has the docs; the
quantization they build on is :mod:`jmp_lab._src.numerics.fp8_quantize`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

from jmp_lab._src.matmuls import contracts_nothing
from jmp_lab._src.numerics.consumer_layout import laid_out_for_consumer
from jmp_lab._src.numerics.fp8_quantize import (current_scale, observation,
                                                quantize)
from jmp_lab._src.numerics.fp8_state import E4M3, E5M2, Fp8Meta, check_meta
from jmp_lab.kernels import cast_transpose
from jmp_lab.kernels.mesh import explicitly_sharded


# --- the products -------------------------------------------------------------


def _fp8_product(product: Callable[[jax.Array, jax.Array], jax.Array],
                 lhs: jax.Array, rhs: jax.Array, meta: Optional[Fp8Meta],
                 out_sharding) -> jax.Array:
  """``product(lhs, rhs)`` (a matmul or einsum of the two) with E4M3
  operands and an E5M2 output gradient; ``rhs`` is the kernel."""
  if out_sharding is not None:
    raise ValueError(f"an fp8 matmul does not take out_sharding (got "
                     f"{out_sharding!r})")
  if meta is not None:
    check_meta(meta)
  return _general_matmul(product, lhs.astype(rhs.dtype), rhs, meta)


# --- a Dense layer's product: the backward written out -----------------------


def _dense_contraction(lhs: jax.Array, rhs: jax.Array, dimension_numbers
                       ) -> int:
  """How many axes a Dense-like ``dot_general`` contracts (``lhs``'s last
  ones with ``rhs``'s first ones, no batch axes), or 0 for another kind."""
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = (
      dimension_numbers)
  n = len(lhs_contracting)
  if (lhs_batch or rhs_batch or n == 0 or n != len(rhs_contracting)
      or tuple(lhs_contracting) != tuple(range(lhs.ndim - n, lhs.ndim))
      or tuple(rhs_contracting) != tuple(range(n))):
    return 0
  return n


def _quantizer(meta: Optional[Fp8Meta]) -> Callable[..., jax.Array]:
  """How the products quantize: behind :func:`quantize`'s barrier under
  delayed scaling, where XLA then fuses each tensor's amax parts into its
  quantizing kernel; plainly under current scaling, whose amax is a
  reduction of its own that must finish first, so the barrier would only
  keep XLA from fusing the cast into its readers (GPT-2 small's step
  compiled for the H100 took 2,417 kernels with it; benchmarks/RESULTS.md,
  issue 39)."""
  if meta is not None:
    return quantize
  return lambda x, q_dtype, scale: fp8_ops.quantize(x, q_dtype, scale,
                                                    x.dtype)


def _operand_scales(x: jax.Array, w: jax.Array, meta: Optional[Fp8Meta]
                    ) -> tuple[jax.Array, jax.Array]:
  if meta is None:
    return current_scale(x, E4M3), current_scale(w, E4M3)
  return meta["input_scale"], meta["kernel_scale"]


@jax.custom_vjp
def _dense_matmul(x: jax.Array, w: jax.Array, b: Optional[jax.Array],
                  meta: Optional[Fp8Meta]) -> jax.Array:
  return _dense_matmul_fwd(x, w, b, meta)[0]


def _quantized_operands(x: jax.Array, w: jax.Array, meta: Optional[Fp8Meta]
                        ) -> tuple[jax.Array, jax.Array, tuple, Any]:
  """The forward's fp8 operands ``(qx, qw)``, their scales and (delayed
  scaling) what the step observes of them: what both products' forward
  rules compute, and their residuals."""
  if meta is None:
    # Current scaling quantizes an input shared by two layers (a gated
    # MLP's gate and up projections) identically for both: XLA then
    # merges the quantizations, merges the two GEMMs that read the one
    # result into one over a concatenated kernel, and that GEMM is no
    # longer the fp8 pattern: 16-bit on the H100. Tying the input to its
    # own kernel keeps one quantization, and one fp8 GEMM, per layer.
    x, w = jax.lax.optimization_barrier((x, w))
  x_scale, w_scale = _operand_scales(x, w, meta)
  to_fp8 = _quantizer(meta)
  qx = to_fp8(x, E4M3, x_scale)
  # The weight is quantized where it lies (on its shard, under FSDP: the
  # scale is the whole tensor's) and laid out for the GEMM as fp8, so an
  # all-gather moves one byte per weight. The backward reads this same
  # tensor: under remat the recomputed forward's gather also serves the
  # input-gradient GEMM, and a weight crosses the network twice a step, as
  # in a 16-bit step (the backward quantizing again would gather again).
  qw = laid_out_for_consumer(to_fp8(w, E4M3, w_scale))
  observed = None if meta is None else (
      observation(x, meta["input_scale"], meta["input_amax_history"]),
      observation(w, meta["kernel_scale"], meta["kernel_amax_history"]))
  return qx, qw, (x_scale, w_scale), observed


def _dequantized(qx: jax.Array, qw: jax.Array, scales: tuple, dtype
                 ) -> tuple[jax.Array, jax.Array]:
  return (fp8_ops.dequantize(qx, dtype, scales[0]),
          fp8_ops.dequantize(qw, dtype, scales[1]))


def _seen(meta: Fp8Meta, observed: tuple, g_seen: tuple) -> Fp8Meta:
  """The scaling state's cotangent: what the step observed of the input,
  the kernel and the output gradient (``next_meta`` reads it)."""
  (input_seen, kernel_seen) = observed
  return {"input_scale": input_seen[0], "input_amax_history": input_seen[1],
          "kernel_scale": kernel_seen[0],
          "kernel_amax_history": kernel_seen[1],
          "output_grad_scale": g_seen[0],
          "output_grad_amax_history": g_seen[1]}


def _dense_matmul_fwd(x, w, b, meta):
  qx, qw, scales, observed = _quantized_operands(x, w, meta)
  y = jax.lax.dot_general(*_dequantized(qx, qw, scales, w.dtype),
                          (((1,), (0,)), ((), ())))
  if b is not None:
    # Added to the 2-D product, a bias is the GEMM's epilogue (cuBLASLt's
    # bias vector); added to a 4-D output, as flax's DenseGeneral adds a
    # (heads, head_dim) bias, XLA broadcast it into a full matrix first.
    y = y + b.astype(y.dtype)[None, :]
  # The fp8 operands are the residuals: the backward GEMMs read them (fp8
  # on the H100 under nn.scan too, where a 16-bit residual would cross the
  # loop), and the backward does not quantize the weights again.
  return y, (qx, qw, scales, meta, observed, b)


def _output_gradient_scale(g: jax.Array, meta: Optional[Fp8Meta]
                           ) -> jax.Array:
  """The output gradient's E5M2 scale: its own amax's under current
  scaling, the stored one under delayed scaling."""
  if meta is None:
    return current_scale(g, E5M2)
  return meta["output_grad_scale"]


def _seen_output_gradient(meta: Fp8Meta, maxima: jax.Array
                          ) -> tuple[jax.Array, jax.Array]:
  scale, history = meta["output_grad_scale"], meta["output_grad_amax_history"]
  if history.ndim != 1:  # an unusual history: the amax in the scale slot
    return (jnp.max(maxima).reshape(jnp.shape(scale)),
            jnp.zeros_like(history))
  return jnp.zeros_like(scale), maxima.reshape(history.shape)


def _explicit_sharding(like: jax.Array):
  """``like``'s sharding where its mesh has explicit axes (sharding in
  types: a gradient GEMM that contracts a sharded axis must name its
  result's, as autodiff's transpose of a dot does), else None."""
  return jax.typeof(like).sharding if explicitly_sharded(like) else None


def _output_gradient_layouts(g: jax.Array, scale: jax.Array,
                             meta: Optional[Fp8Meta], with_sums: bool):
  """``(q_g, q_g.T, maxima, column sums or None)`` of the output gradient:
  the input gradient's GEMM reads ``q_g``, the weight gradient's ``q_g.T``
  (its token axis, the contracted one, innermost, as Hopper's fp8 GEMMs
  read it), and the bias gradient is the column sums, in fp32.

  Under delayed scaling the cast-transpose kernel writes both layouts, the
  maxima the history needs and the sums from one read of ``g``. Current
  scaling keeps no history and has read ``g`` once already for its scale;
  it takes XLA's quantization and transpose, as its autodiff product did
  (GPT-2 small's step compiled for the H100: 2,250 kernels and 77.1 GB,
  against 2,271 and 78.3 through the kernel).
  """
  if meta is None:
    q_g = fp8_ops.quantize(g, E5M2, scale, g.dtype)
    sums = jnp.sum(g.astype(jnp.float32), axis=0) if with_sums else None
    return q_g, q_g.T, None, sums
  history = meta["output_grad_amax_history"]
  programs = history.shape[-1] if history.ndim == 1 else 1
  q_g, q_g_t, maxima, *sums = cast_transpose.quantize_transpose(
      g, scale, E5M2, programs, lambda x, s: quantize(x, E5M2, s),
      column_sums=with_sums)
  return q_g, q_g_t, maxima, sums[0] if with_sums else None


def _dense_matmul_bwd(residuals, g):
  qx, qw, scales, meta, observed, bias = residuals
  dtype = g.dtype
  scale = _output_gradient_scale(g, meta)
  q_g, q_g_t, maxima, sums = _output_gradient_layouts(
      g, scale, meta, with_sums=bias is not None)
  d_b = None if bias is None else sums.astype(bias.dtype)  # (N,)
  x, w = _dequantized(qx, qw, scales, dtype)
  d_x = jax.lax.dot_general(fp8_ops.dequantize(q_g, dtype, scale), w,
                            (((1,), (1,)), ((), ())),
                            out_sharding=_explicit_sharding(qx))
  d_w = jax.lax.dot_general(x, fp8_ops.dequantize(q_g_t, dtype, scale),
                            (((0,), (1,)), ((), ())),
                            out_sharding=_explicit_sharding(qw))
  seen = None if meta is None else _seen(
      meta, observed, _seen_output_gradient(meta, maxima))
  return d_x.astype(dtype), d_w.astype(dtype), d_b, seen


_dense_matmul.defvjp(_dense_matmul_fwd, _dense_matmul_bwd)


# --- any product (an einsum, a dot_general with batch axes) ------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _general_matmul(product: Callable[[jax.Array, jax.Array], jax.Array],
                    lhs: jax.Array, rhs: jax.Array,
                    meta: Optional[Fp8Meta]) -> jax.Array:
  return _general_matmul_fwd(product, lhs, rhs, meta)[0]


def _general_matmul_fwd(product, lhs, rhs, meta):
  # As the Dense product: the fp8 operands (the kernel as laid out for its
  # GEMM) are the residuals, so the backward reads fp8 under nn.scan and
  # gathers nothing again under FSDP; the backward is the transpose of
  # ``product`` at the dequantized operands.
  qx, qw, scales, observed = _quantized_operands(lhs, rhs, meta)
  y = product(*_dequantized(qx, qw, scales, rhs.dtype))
  return y, (qx, qw, scales, meta, observed)


def _general_matmul_bwd(product, residuals, g):
  qx, qw, scales, meta, observed = residuals
  scale = _output_gradient_scale(g, meta)
  g_seen = None if meta is None else observation(
      g, scale, meta["output_grad_amax_history"])
  g = fp8_ops.dequantize(_quantizer(meta)(g, E5M2, scale), g.dtype, scale)
  x, w = _dequantized(qx, qw, scales, g.dtype)
  # The product is linear in each operand: transposing each map gives its
  # gradient without evaluating the product again (jax.vjp would, and
  # leave the audit an extra GEMM that XLA drops).
  (d_lhs,) = jax.linear_transpose(lambda a: product(a, w), x)(g)
  (d_rhs,) = jax.linear_transpose(lambda b: product(x, b), w)(g)
  seen = None if meta is None else _seen(meta, observed, g_seen)
  return d_lhs, d_rhs, seen


_general_matmul.defvjp(_general_matmul_fwd, _general_matmul_bwd)


def _dense_product(lhs: jax.Array, rhs: jax.Array, meta: Optional[Fp8Meta],
                   contracted: int, bias: Optional[jax.Array] = None
                   ) -> jax.Array:
  """A Dense layer's fp8 product (delayed scaling with ``meta``, current
  without; plus ``bias``), as one 2-D matmul whose backward is written out:
  the backward reads the forward's fp8 weight, as laid out for the forward's
  GEMM (gathered once under FSDP), and its output gradient is
  quantized once into both layouts the two gradient GEMMs read, and summed
  into the bias gradient in the same pass
  (:func:`jmp_lab.kernels.cast_transpose.quantize_transpose`), where
  autodiff's backward left XLA to transpose the quantized gradient in a
  second pass and to read it once more for the bias."""
  compute = rhs.dtype
  width = int(np.prod(rhs.shape[:contracted]))
  lead = lhs.shape[:lhs.ndim - contracted]
  features = rhs.shape[contracted:]
  # Each reshape merges (or splits) one group of axes: under sharding in
  # types jax infers the result's sharding only for such a reshape.
  x = lhs.astype(compute).reshape(*lead, width).reshape(-1, width)
  flat_bias = None if bias is None else bias.reshape(-1)
  y = _dense_matmul(x, rhs.reshape(width, -1), flat_bias, meta)
  return y.reshape(*lead, y.shape[-1]).reshape(*lead, *features)


def _check_bias(bias: Any, features: tuple[int, ...]) -> None:
  if bias is None:
    return
  if not (hasattr(bias, "shape") and hasattr(bias, "dtype")
          and jnp.issubdtype(bias.dtype, jnp.floating)):
    raise TypeError(f"bias must be a floating-point array, got {bias!r}")
  if tuple(bias.shape) != tuple(features):
    raise ValueError(
        f"bias must have the product's feature shape {tuple(features)} (the "
        f"trailing axes of the result), got shape {tuple(bias.shape)}")


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                precision=None, preferred_element_type=None, *,
                meta: Optional[Fp8Meta] = None,
                bias: Optional[jax.Array] = None, out_sharding=None
                ) -> jax.Array:
  """``lax.dot_general`` as an fp8 GEMM: E4M3 operands, E5M2 gradient.

  ``rhs`` is the kernel; ``lhs`` is cast to its dtype (the compute dtype),
  in which the result is returned. With ``meta`` (:func:`init_meta`) the
  scaling is delayed, and the gradient with respect to ``meta`` is the
  updated meta (overwrite-with-gradient); without, it is current scaling.
  ``precision`` and ``preferred_element_type`` are not used: an fp8 GEMM
  accumulates in fp32 and returns the compute dtype.

  ``bias`` (shaped as the result's trailing, ``rhs``'s free, axes; any
  float dtype) is added to the result. For a Dense-like product (``lhs``'s
  last axes with ``rhs``'s first) it is added to the 2-D product, where XLA
  makes it the GEMM's bias epilogue, and its gradient, summed in fp32 and
  returned in its own dtype, comes out of the kernel that quantizes the
  output gradient (Transformer Engine's ``cast_transpose_dbias``). The
  linen and NNX policies pass a Dense layer's bias here. Otherwise it is
  added to the result.

  The kernel is quantized where it lies and moves as fp8: under FSDP each
  device quantizes its shard (with the whole tensor's scale) and the GEMM's
  all-gather carries fp8. The backward reads the fp8 operands the forward
  kept (under ``nn.scan`` too): with remat, the recomputed forward's gather
  serves the input-gradient GEMM too (a weight is gathered twice a step);
  without, the forward's gathered kernel is held until the backward
  (gathered once). The output gradient is E5M2.

  >>> import jax, jax.numpy as jnp
  >>> x, w = jnp.full((8, 4), 3.0, jnp.bfloat16), jnp.ones((4, 2), jnp.bfloat16)
  >>> from jmp_lab.fp8 import init_meta
  >>> meta = init_meta(4)
  >>> y = dot_general(x, w, (((1,), (0,)), ((), ())), meta=meta,
  ...                 bias=jnp.array([0.5, -1.0]))
  >>> y.dtype, y[0].tolist()   # scales of 1: 12 + bias
  (dtype(bfloat16), [12.5, 11.0])
  >>> loss = lambda b: dot_general(x, w, (((1,), (0,)), ((), ())), meta=meta,
  ...                              bias=b).astype(jnp.float32).sum()
  >>> jax.grad(loss)(jnp.zeros(2)).tolist()   # summed over the 8 rows
  [8.0, 8.0]
  """
  del precision, preferred_element_type
  if meta is None and contracts_nothing(lhs, dimension_numbers):
    # No GEMM (an elementwise scale by a param written as an einsum): in
    # fp8 it rounded both operands to E4M3 for nothing, 10x bf16's error.
    out = jax.lax.dot_general(jnp.asarray(lhs, rhs.dtype), rhs,
                              dimension_numbers, out_sharding=out_sharding)
    return out if bias is None else out + bias.astype(out.dtype)
  contracted = _dense_contraction(lhs, rhs, dimension_numbers)
  if contracted:
    if out_sharding is not None:
      raise ValueError(f"an fp8 matmul does not take out_sharding (got "
                       f"{out_sharding!r})")
    if meta is not None:
      check_meta(meta)
    _check_bias(bias, rhs.shape[contracted:])
    return _dense_product(lhs, rhs, meta, contracted, bias)
  out = _fp8_product(
      lambda a, b: jax.lax.dot_general(a, b, dimension_numbers),
      lhs, rhs, meta, out_sharding)
  if bias is None:
    return out
  (_, rhs_contracting), (_, rhs_batch) = dimension_numbers
  rhs_free = rhs.ndim - len(rhs_contracting) - len(rhs_batch)
  _check_bias(bias, out.shape[out.ndim - rhs_free:])
  return out + bias.astype(out.dtype)


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


def operands_in(matmul: Callable[..., jax.Array], dtype: Any, *,
                einsum: bool = False) -> Callable[..., jax.Array]:
  """``matmul`` (an fp8 ``dot_general`` or, with ``einsum=True``, an fp8
  einsum whose subscripts come first) with its two operands cast to
  ``dtype`` first: the layer attribute a policy installs.

  A layer with its own ``dtype=jnp.float32`` hands its matmul fp32
  operands, and XLA rewrites quantize-dequantize into an fp8 GEMM only
  around a half-precision one: cast to the compute dtype first, they
  compile to fp8 on the H100 (fp32, to 16-bit GEMMs).

  >>> import jax.numpy as jnp
  >>> dot = operands_in(current_dot_general, jnp.bfloat16)
  >>> dot(jnp.ones((2, 4)), jnp.ones((4, 3)), (((1,), (0,)), ((), ()))).dtype
  dtype(bfloat16)
  """
  first = 1 if einsum else 0

  def cast_then_multiply(*args, **kwargs):
    args = list(args)
    for i in (first, first + 1):
      if jnp.issubdtype(jnp.result_type(args[i]), jnp.floating):
        args[i] = jnp.asarray(args[i]).astype(dtype)
    return matmul(*args, **kwargs)

  return cast_then_multiply


def delayed_dot_general(meta: Fp8Meta, bias: Optional[jax.Array] = None
                        ) -> Callable[..., jax.Array]:
  """:func:`dot_general` with delayed scaling from ``meta`` (and ``bias``
  added inside the product), with the signature of ``lax.dot_general``."""

  def fn(lhs, rhs, dimension_numbers, precision=None,
         preferred_element_type=None, out_sharding=None):
    return dot_general(lhs, rhs, dimension_numbers, precision,
                       preferred_element_type, meta=meta, bias=bias,
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
