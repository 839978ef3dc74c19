"""Weight gradients in the policy's reduce dtype: a drop-in ``dot_general``.

The implementation behind :mod:`jmp_lab.reduce`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
import opt_einsum  # a dependency of jax: its einsum's own parser
from jax import lax

from jmp_lab._gemm import accumulated


def _remaining(ndim: int, *removed: Sequence[int]) -> list[int]:
  gone = {int(i) for axes in removed for i in axes}
  return [i for i in range(ndim) if i not in gone]


def _ranges_like(*groups: Sequence[int]):
  start = 0
  for group in groups:
    yield list(range(start, start + len(group)))
    start += len(group)


def _transpose_lhs(g, lhs_ndim: int, rhs, dimension_numbers, precision,
                   preferred_element_type, swap_ans: bool = False):
  """The left operand's cotangent of ``dot_general`` (jax's own transpose
  rule, with the GEMM's ``preferred_element_type`` chosen by the caller)."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  lhs_kept = _remaining(lhs_ndim, lhs_contract, lhs_batch)
  rhs_kept = _remaining(rhs.ndim, rhs_contract, rhs_batch)
  if swap_ans:
    ans_batch, ans_rhs, _ = _ranges_like(lhs_batch, rhs_kept, lhs_kept)
  else:
    ans_batch, _, ans_rhs = _ranges_like(lhs_batch, lhs_kept, rhs_kept)
  dims = ((ans_rhs, rhs_kept), (ans_batch, list(rhs_batch)))
  lhs_contract_by_rhs = list(np.take(lhs_contract, np.argsort(rhs_contract)))
  out_axes = np.argsort(list(lhs_batch) + lhs_kept + lhs_contract_by_rhs)
  def gemm(g, rhs):
    return lax.dot_general(g, rhs, dims, precision=precision,
                           preferred_element_type=preferred_element_type)

  product = (gemm(g, rhs) if preferred_element_type is None
             else accumulated(gemm, (g, rhs), preferred_element_type))
  return lax.transpose(product, tuple(int(a) for a in out_axes))


def _transpose_rhs(g, lhs, rhs_ndim: int, dimension_numbers, precision,
                   preferred_element_type):
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
  return _transpose_lhs(g, rhs_ndim, lhs, swapped, precision,
                        preferred_element_type, swap_ans=True)


@functools.lru_cache(maxsize=None)
def dot_general(reduce_dtype: Any) -> Callable[..., jax.Array]:
  """``lax.dot_general`` whose weight gradient is summed in ``reduce_dtype``.

  The returned function takes ``(lhs, rhs, dimension_numbers, precision=None,
  preferred_element_type=None)``, as flax's ``dot_general`` attribute does;
  ``rhs`` is the weight.
  """
  reduce_dtype = np.dtype(reduce_dtype)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
  def dot(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)

  def forward(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    return dot(lhs, rhs, dimension_numbers, precision,
               preferred_element_type), (lhs, rhs)

  def backward(dimension_numbers, precision, preferred_element_type,
               residuals, g):
    lhs, rhs = residuals
    d_lhs = _transpose_lhs(g, lhs.ndim, rhs, dimension_numbers, precision,
                           preferred_element_type)
    # The weight gradient: the same operands, accumulated and returned in
    # the reduce dtype, so the cross-device sum that follows runs in it.
    d_rhs = _transpose_rhs(g, lhs, rhs.ndim, dimension_numbers, precision,
                           reduce_dtype)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)

  dot.defvjp(forward, backward)

  def dot_general_fn(lhs, rhs, dimension_numbers, precision=None,
                     preferred_element_type=None, out_sharding=None):
    _check_no_out_sharding(out_sharding)
    dimension_numbers = tuple(tuple(tuple(int(i) for i in axes)
                                    for axes in pair)
                              for pair in dimension_numbers)
    return dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)

  return dot_general_fn


def _check_no_out_sharding(out_sharding) -> None:
  # Flax NNX passes out_sharding (None unless the caller sets one).
  if out_sharding is not None:
    raise ValueError(
        f"a reduce-dtype matmul does not take out_sharding (got "
        f"{out_sharding!r}): leave the layer's out_sharding unset and let "
        f"jit's partitioner place the result")


# --------------------------------------------------------------------------
# Convolutions.
# --------------------------------------------------------------------------


def _dilate_shape(shape, dilation):
  return tuple(0 if d == 0 else 1 + r * (d - 1) for d, r in zip(shape, dilation))


def _conv_rhs_vjp_padding(in_shape, window_shape, window_strides, out_shape,
                          padding, lhs_dilation, rhs_dilation):
  """The padding of the convolution that gives the kernel's gradient (jax's
  ``_conv_general_vjp_rhs_padding``)."""
  lhs_dilated = _dilate_shape(in_shape, lhs_dilation)
  rhs_dilated = _dilate_shape(window_shape, rhs_dilation)
  out_dilated = _dilate_shape(out_shape, window_strides)
  pads_lo = [lo for lo, _ in padding]
  pads_hi = [o - i + (r - lo - 1) for o, i, r, lo in
             zip(out_dilated, lhs_dilated, rhs_dilated, pads_lo)]
  return list(zip(pads_lo, pads_hi))


def _conv_transpose_rhs(g, lhs, rhs_shape, *, window_strides, padding,
                        lhs_dilation, rhs_dilation, dimension_numbers,
                        precision, preferred_element_type):
  """The kernel's cotangent of a convolution (jax's own transpose rule, for
  feature and batch groups of 1, with ``preferred_element_type`` chosen by
  the caller)."""
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  transpose = lambda spec: (spec[1], spec[0]) + tuple(spec[2:])  # noqa: E731
  trans_dims = lax.ConvDimensionNumbers(transpose(lhs_spec), transpose(out_spec),
                                        transpose(rhs_spec))
  vjp_padding = _conv_rhs_vjp_padding(
      np.take(lhs.shape, lhs_spec[2:]), np.take(rhs_shape, rhs_spec[2:]),
      window_strides, np.take(g.shape, out_spec[2:]), padding, lhs_dilation,
      rhs_dilation)
  return lax.conv_general_dilated(
      lhs, g, window_strides=rhs_dilation, padding=vjp_padding,
      lhs_dilation=lhs_dilation, rhs_dilation=window_strides,
      dimension_numbers=trans_dims, precision=precision,
      preferred_element_type=preferred_element_type)


@functools.lru_cache(maxsize=None)
def conv_general_dilated(reduce_dtype: Any) -> Callable[..., jax.Array]:
  """``lax.conv_general_dilated`` whose kernel gradient is summed in
  ``reduce_dtype`` (see the module doc). Takes the arguments flax's ``Conv``
  passes; feature and batch groups other than 1 are refused.
  """
  reduce_dtype = np.dtype(reduce_dtype)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
  def conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
           dimension_numbers, precision, preferred_element_type):
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
        dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type)

  def forward(lhs, rhs, *static):
    return conv(lhs, rhs, *static), (lhs, rhs)

  def backward(window_strides, padding, lhs_dilation, rhs_dilation,
               dimension_numbers, precision, preferred_element_type,
               residuals, g):
    lhs, rhs = residuals
    _, lhs_vjp = jax.vjp(
        lambda x: lax.conv_general_dilated(
            x, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
            dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type), lhs)
    d_rhs = _conv_transpose_rhs(
        g, lhs, rhs.shape, window_strides=window_strides, padding=padding,
        lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, precision=precision,
        preferred_element_type=reduce_dtype)
    return lhs_vjp(g)[0].astype(lhs.dtype), d_rhs.astype(rhs.dtype)

  conv.defvjp(forward, backward)

  def conv_fn(lhs, rhs, window_strides, padding, lhs_dilation=None,
              rhs_dilation=None, dimension_numbers=None,
              feature_group_count=1, batch_group_count=1, precision=None,
              preferred_element_type=None, out_sharding=None):
    _check_no_out_sharding(out_sharding)
    if feature_group_count != 1 or batch_group_count != 1:
      raise ValueError(
          f"jmp_lab.reduce.conv_general_dilated supports feature_group_count "
          f"and batch_group_count of 1, got {feature_group_count} and "
          f"{batch_group_count}")
    spatial = lhs.ndim - 2
    window_strides = tuple(window_strides)
    lhs_dilation = tuple(lhs_dilation or (1,) * spatial)
    rhs_dilation = tuple(rhs_dilation or (1,) * spatial)
    dims = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    if isinstance(padding, str):
      in_spatial = np.take(lhs.shape, dims.lhs_spec[2:])
      window = _dilate_shape(np.take(rhs.shape, dims.rhs_spec[2:]),
                             rhs_dilation)
      padding = lax.padtype_to_pads(_dilate_shape(in_spatial, lhs_dilation),
                                    window, window_strides, padding)
    padding = tuple((int(lo), int(hi)) for lo, hi in padding)
    return conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                dims, precision, preferred_element_type)

  return conv_fn


# --------------------------------------------------------------------------
# Einsums, and gradients attached after a layer's own computation.
# --------------------------------------------------------------------------


def einsum_subscripts(subscripts: str, lhs, rhs) -> tuple[str, str, str]:
  """The subscripts of ``jnp.einsum(subscripts, lhs, rhs)`` with ellipses
  spelled out, as ``(lhs, rhs, output)``; ``lhs`` and ``rhs`` are arrays or
  shape-dtype structs.

  >>> import jax, jax.numpy as jnp
  >>> einsum_subscripts("...d,dk->...k", jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
  ('bcd', 'dk', 'bck')
  """
  if subscripts.count(",") != 1 or "->" not in subscripts:
    raise ValueError(
        f"einsum subscripts must name two operands and the output "
        f"(\"lhs,rhs->out\") where jmp_lab computes an einsum's weight or "
        f"bias gradient itself, got {subscripts!r}")
  inputs, output, _ = opt_einsum.parser.parse_einsum_input(
      (subscripts, lhs, rhs))
  lhs_names, rhs_names = inputs.split(",")
  if len(set(rhs_names)) != len(rhs_names):
    raise ValueError(
        f"einsum subscripts cannot repeat a subscript of the weight (second "
        f"operand, a diagonal) where jmp_lab computes its gradient, got "
        f"{subscripts!r}")
  return lhs_names, rhs_names, output


def einsum_bias_broadcast(subscripts: str, lhs, rhs) -> tuple[int, ...]:
  """The shape flax's ``Einsum`` (linen and NNX) reshapes its bias to before
  adding it: the output's axes that the weight has, 1 elsewhere.

  >>> import jax.numpy as jnp
  >>> einsum_bias_broadcast("btd,dh->hbt", jnp.ones((2, 5, 4)), jnp.ones((4, 3)))
  (3, 1, 1)
  """
  _, rhs_names, out_names = einsum_subscripts(subscripts, lhs, rhs)
  return tuple(rhs.shape[rhs_names.index(c)] if c in rhs_names else 1
               for c in out_names)


def einsum_rhs_gradient(subscripts: str, lhs, g, rhs_shape: Sequence[int],
                        reduce_dtype: Any) -> jax.Array:
  """The second operand's cotangent of ``jnp.einsum(subscripts, lhs, rhs)``,
  its product accumulated and returned in ``reduce_dtype`` (``g`` is the
  output's cotangent)."""
  lhs_names, rhs_names, out_names = einsum_subscripts(
      subscripts, lhs, jax.ShapeDtypeStruct(tuple(rhs_shape), g.dtype))
  # A weight axis in neither the input nor the output is summed out by the
  # forward einsum: its gradient is the same along it.
  kept = "".join(c for c in rhs_names if c in lhs_names or c in out_names)
  product = accumulated(
      lambda lhs, g: jax.numpy.einsum(f"{lhs_names},{out_names}->{kept}",
                                      lhs, g,
                                      preferred_element_type=reduce_dtype),
      (lhs, g), reduce_dtype)
  expanded = lax.expand_dims(product, [i for i, c in enumerate(rhs_names)
                                       if c not in kept])
  return jax.numpy.broadcast_to(expanded, tuple(rhs_shape))


@functools.lru_cache(maxsize=None)
def einsum(reduce_dtype: Any) -> Callable[..., jax.Array]:
  """``jnp.einsum`` of two operands whose second (the weight) gets its
  gradient summed in ``reduce_dtype``: flax NNX's ``Einsum(einsum_op=...)``.

  The returned function takes ``(subscripts, lhs, rhs, precision=None,
  preferred_element_type=None, out_sharding=None)``.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> op = einsum(jnp.float32)
    >>> x, w = jnp.ones((2, 8, 4), jnp.bfloat16), jnp.ones((4, 3), jnp.bfloat16)
    >>> loss = lambda w: op("btd,dk->btk", x, w).astype(jnp.float32).sum()
    >>> float(jax.grad(loss)(w)[0, 0])
    16.0
  """
  reduce_dtype = np.dtype(reduce_dtype)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
  def product(subscripts, lhs, rhs, precision, preferred_element_type):
    return jax.numpy.einsum(subscripts, lhs, rhs, precision=precision,
                            preferred_element_type=preferred_element_type)

  def forward(subscripts, lhs, rhs, precision, preferred_element_type):
    return product(subscripts, lhs, rhs, precision,
                   preferred_element_type), (lhs, rhs)

  def backward(subscripts, precision, preferred_element_type, residuals, g):
    lhs, rhs = residuals
    _, lhs_vjp = jax.vjp(lambda x: jax.numpy.einsum(
        subscripts, x, rhs, precision=precision,
        preferred_element_type=preferred_element_type), lhs)
    d_rhs = einsum_rhs_gradient(subscripts, lhs, g, rhs.shape, reduce_dtype)
    return lhs_vjp(g)[0].astype(lhs.dtype), d_rhs.astype(rhs.dtype)

  product.defvjp(forward, backward)

  def einsum_fn(subscripts, lhs, rhs, precision=None,
                preferred_element_type=None, out_sharding=None):
    _check_no_out_sharding(out_sharding)
    einsum_subscripts(subscripts, lhs, rhs)  # checks the equation
    return product(subscripts.replace(" ", ""), lhs, rhs, precision,
                   preferred_element_type)

  return einsum_fn


def embed_attend(query, embedding, compute_dtype: Any, reduce_dtype: Any
                 ) -> jax.Array:
  """``Embed.attend`` (the logits of a tied embedding: ``query @
  embedding.T``) with both operands in ``compute_dtype`` and the table's
  gradient accumulated and returned in ``reduce_dtype``.

  >>> import jax, jax.numpy as jnp
  >>> table = jnp.ones((5, 4))
  >>> loss = lambda t: embed_attend(jnp.ones((2, 4)), t, jnp.bfloat16,
  ...                               jnp.float32).astype(jnp.float32).sum()
  >>> jax.grad(loss)(table).dtype, float(jax.grad(loss)(table)[0, 0])
  (dtype('float32'), 2.0)
  """
  query = query.astype(compute_dtype)
  embedding = embedding.astype(compute_dtype)
  dims = (((query.ndim - 1,), (1,)), ((), ()))
  return dot_general(reduce_dtype)(query, embedding, dims)


def bias_gradient(g, broadcast_shape: Sequence[int], reduce_dtype: Any
                  ) -> jax.Array:
  """The gradient of a bias added as ``y + bias.reshape(broadcast_shape)``:
  ``g`` summed over the broadcast axes in ``reduce_dtype``, in the bias's
  broadcast shape (a reshape away from the bias's own)."""
  pad = g.ndim - len(broadcast_shape)
  shape = (1,) * pad + tuple(broadcast_shape)
  axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
  summed = g.astype(reduce_dtype).sum(axis=axes, keepdims=True)
  return summed.reshape(shape[pad:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def with_param_gradient(param_gradient: Callable, y, param, context):
  """``y``, unchanged; differentiated, ``param``'s cotangent is
  ``param_gradient(g, context)`` (``g``: ``y``'s cotangent), cast to
  ``param``'s dtype, and ``context`` gets none.

  For a layer that reads ``param`` through ``lax.stop_gradient``: its own
  gradient path is cut, and this one computes the gradient in the reduce
  dtype instead (how :func:`jmp_lab.linen.with_policy` reaches biases and
  ``nn.Einsum``). The forward pass is the layer's own, bit for bit.
  ``param_gradient`` must be a hashable function.
  """
  del param, context
  return y


def _with_param_gradient_forward(param_gradient, y, param, context):
  # The param is kept only for its shape and dtype: the layer holds it
  # anyway, so XLA keeps no extra copy.
  return y, (param, context)


def _with_param_gradient_backward(param_gradient, residuals, g):
  param, context = residuals
  d_param = param_gradient(g, context).reshape(param.shape)
  return (g, d_param.astype(param.dtype),
          jax.tree_util.tree_map(jax.numpy.zeros_like, context))


with_param_gradient.defvjp(_with_param_gradient_forward,
                           _with_param_gradient_backward)
