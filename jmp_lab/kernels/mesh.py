"""Shardings for the kernels' ``custom_partitioning`` rules, which split an
operand by its first axis (its tokens or rows), or by blocks."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def leading_mesh_axes(sharding) -> tuple:
  """The mesh axes that split an operand's first axis, read from a
  ``NamedSharding``; ``()`` when it is whole."""
  spec = getattr(sharding, "spec", None)
  if not spec or spec[0] is None:
    return ()
  return tuple(spec[0]) if isinstance(spec[0], tuple) else (spec[0],)


def axes_per_dim(sharding, ndim: int) -> list[tuple]:
  """The mesh axes that split each of an ``ndim``-dimensional array's
  axes under a ``NamedSharding`` (``()`` where an axis is whole).

  >>> import jax, numpy as np
  >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
  >>> axes_per_dim(NamedSharding(mesh, P(("data", "fsdp"))), 2)
  [('data', 'fsdp'), ()]
  """
  spec = tuple(getattr(sharding, "spec", ()) or ())
  entries = [spec[d] if d < len(spec) else None for d in range(ndim)]
  return [() if e is None else tuple(e) if isinstance(e, tuple) else (e,)
          for e in entries]


def explicitly_sharded(x) -> bool:
  """Whether ``x``'s type carries a mesh with explicit axes (sharding in
  types), where an op must name its result's sharding whenever jax cannot
  infer it, and a Pallas kernel cannot slice a sharded ref.

  >>> import jax.numpy as jnp
  >>> explicitly_sharded(jnp.ones(3))
  False
  """
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return any(t == jax.sharding.AxisType.Explicit
             for t in getattr(mesh, "axis_types", ()))


def _entry(axes: tuple):
  return (axes if len(axes) > 1 else axes[0]) if axes else None


def split_over(mesh, axes: tuple, ndim: int, dim: int = 0) -> NamedSharding:
  """The ``NamedSharding`` of an ``ndim``-dimensional array whose axis
  ``dim`` is split over the mesh ``axes`` (whole when there are none)."""
  spec = [None] * ndim
  if ndim:
    spec[dim] = _entry(axes)
  return NamedSharding(mesh, PartitionSpec(*spec))


def split_dims(mesh, *axes_per_dim: tuple) -> NamedSharding:
  """The ``NamedSharding`` of an array whose i-th axis is split over the
  mesh axes ``axes_per_dim[i]`` (whole where that is ``()``)."""
  return NamedSharding(mesh, PartitionSpec(*map(_entry, axes_per_dim)))


__all__ = [
    "axes_per_dim",
    "explicitly_sharded",
    "leading_mesh_axes",
    "split_dims",
    "split_over",
]
