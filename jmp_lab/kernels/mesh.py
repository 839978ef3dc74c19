"""Shardings for the kernels' ``custom_partitioning`` rules, which split an
operand by its first axis (its tokens or rows), or by blocks."""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec


def leading_mesh_axes(sharding) -> tuple:
  """The mesh axes that split an operand's first axis, read from a
  ``NamedSharding``; ``()`` when it is whole."""
  spec = getattr(sharding, "spec", None)
  if not spec or spec[0] is None:
    return ()
  return tuple(spec[0]) if isinstance(spec[0], tuple) else (spec[0],)


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
    "leading_mesh_axes",
    "split_dims",
    "split_over",
]
