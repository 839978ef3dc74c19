"""The types a block-scaled product's results and gradients take across
devices: shardings on a mesh with explicit axes, and the manual axes a value
varies over inside ``shard_map``.

jax types both. A ``custom_vjp`` must return each gradient in its primal's
type, and ``lax.platform_dependent`` asks its branches for one type, so
:mod:`.block_matmul` states them here rather than leaving them to the ops
that happen to produce its values (``scaled_matmul``'s ``custom_vmap``
drops the manual axes; jax's typing refuses a GEMM over a split contraction
that names no result sharding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmp_lab import _compat as compat


def explicit_axes(*xs: jax.Array) -> tuple[str, ...]:
  """The explicit mesh axes of ``xs``' types: the ones
  ``jax.sharding.auto_axes`` makes Auto (inside a ``shard_map`` the manual
  ones stay manual).

  >>> explicit_axes(jnp.ones(3))
  ()
  """
  axes: list[str] = []
  for x in xs:
    mesh = jax.typeof(x).sharding.mesh
    for name, kind in zip(mesh.axis_names, getattr(mesh, "axis_types", ())):
      if kind == jax.sharding.AxisType.Explicit and name not in axes:
        axes.append(name)
  return tuple(axes)


def result_spec(lhs: jax.Array, rhs: jax.Array, dimension_numbers
                ) -> jax.sharding.PartitionSpec:
  """The sharding of ``lax.dot_general(lhs, rhs, ...)``'s result on a mesh
  with explicit axes: its batch and free axes split as they are in the
  operands (the batch as ``lhs``'s), each mesh axis used once (a split
  contraction is summed).

  >>> result_spec(jnp.ones((4, 8)), jnp.ones((8, 2)), (((1,), (0,)), ((), ())))
  P(None, None)
  """
  (lc, rc), (lb, rb) = dimension_numbers

  def spec(x):
    entries = tuple(jax.typeof(x).sharding.spec)
    return entries + (None,) * (x.ndim - len(entries))

  lhs_spec, rhs_spec = spec(lhs), spec(rhs)
  entries = ([lhs_spec[d] for d in lb]
             + [lhs_spec[d] for d in range(lhs.ndim) if d not in (*lc, *lb)]
             + [rhs_spec[d] for d in range(rhs.ndim) if d not in (*rc, *rb)])
  used: set = set()
  result = []
  for entry in entries:
    axes = () if entry is None else (entry if isinstance(entry, tuple)
                                      else (entry,))
    result.append(None if used & set(axes) else entry)
    used |= set(axes)
  return jax.sharding.PartitionSpec(*result)


def varying_as(out: jax.Array, *operands: jax.Array) -> jax.Array:
  """``out`` varying over every manual axis its ``operands`` vary over
  (unchanged outside ``shard_map``)."""
  varying = frozenset().union(*map(compat.varying_axes, operands))
  missing = tuple(sorted(varying - compat.varying_axes(out)))
  return jax.lax.pcast(out, missing, to="varying") if missing else out


def empty_like(x: jax.Array) -> jax.Array:
  """An empty array of ``x``'s dtype that varies over the manual axes ``x``
  varies over: what a backward needs to know of a primal it does not keep.

  >>> empty_like(jnp.ones(3, jnp.bfloat16)).shape
  (0,)
  """
  return varying_as(jnp.zeros((0,), x.dtype), x)


def as_cotangent_of(ct: jax.Array, like: jax.Array) -> jax.Array:
  """``ct`` summed over the manual axes it varies over and its primal
  (``like``, :func:`empty_like`) does not: the gradient of a weight
  ``shard_map`` replicates, summed as jax's own transpose of the implicit
  ``pvary`` sums it."""
  extra = compat.varying_axes(ct) - compat.varying_axes(like)
  return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


__all__ = ["as_cotangent_of", "empty_like", "explicit_axes", "result_spec",
           "varying_as"]
