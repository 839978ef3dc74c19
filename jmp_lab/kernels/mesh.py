"""Shardings for the kernels' ``custom_partitioning`` rules, which split an
operand by its first axis (its tokens or rows)."""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec


def leading_mesh_axes(sharding) -> tuple:
  """The mesh axes that split an operand's first axis, read from a
  ``NamedSharding``; ``()`` when it is whole."""
  spec = getattr(sharding, "spec", None)
  if not spec or spec[0] is None:
    return ()
  return tuple(spec[0]) if isinstance(spec[0], tuple) else (spec[0],)


def split_over(mesh, axes: tuple, ndim: int, dim: int = 0) -> NamedSharding:
  """The ``NamedSharding`` of an ``ndim``-dimensional array whose axis
  ``dim`` is split over the mesh ``axes`` (whole when there are none)."""
  entry = (axes if len(axes) > 1 else axes[0]) if axes else None
  spec = [None] * ndim
  if ndim:
    spec[dim] = entry
  return NamedSharding(mesh, PartitionSpec(*spec))


__all__ = [
    "leading_mesh_axes",
    "split_over",
]
