"""Data-parallel layouts of a train state, with ZeRO-1 optimizer sharding.

The implementation behind :mod:`jmp_lab.sharding`, whose docstring describes it
with examples.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _check_axis(mesh: Mesh, axis_name: str) -> int:
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got "
                    f"{type(mesh).__name__}")
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; "
                     f"its axes: {', '.join(map(repr, mesh.axis_names))}")
  return mesh.shape[axis_name]


def _split_spec(shape: tuple[int, ...], devices: int, axis_name: str) -> P:
  """The first dimension that splits evenly over ``devices`` (rows first),
  or replicated when none does (scalars, counters, odd shapes)."""
  for dim, size in enumerate(shape):
    if size >= devices and size % devices == 0:
      return P(*([None] * dim), axis_name)
  return P()


def optimizer_state_shardings(opt_state: Any, mesh: Mesh,
                              axis_name: str = "data") -> Any:
  """ZeRO-1: every array of ``opt_state`` split over ``axis_name`` on its
  first evenly divisible dimension (scalars and the rest replicated)."""
  devices = _check_axis(mesh, axis_name)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, _split_spec(tuple(x.shape), devices,
                                                axis_name)), opt_state)


def replicated(tree: Any, mesh: Mesh) -> Any:
  """Every leaf of ``tree`` replicated on ``mesh``."""
  return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree)


def state_shardings(state: Any, mesh: Mesh, axis_name: str = "data", *,
                    shard_optimizer_state: bool = True) -> Any:
  """The data-parallel layout of a :class:`~jmp_lab.TrainState`.

  Params, step and model state replicated; the optimizer state split over
  ``axis_name`` (ZeRO-1), or replicated with
  ``shard_optimizer_state=False``. Works on abstract states
  (``jax.eval_shape``) too.
  """
  _check_axis(mesh, axis_name)
  if not hasattr(state, "opt_state"):
    raise TypeError(f"state must be a jmp_lab.TrainState, got "
                    f"{type(state).__name__}; for an optimizer state alone "
                    f"use optimizer_state_shardings")
  layout = replicated(state, mesh)
  if shard_optimizer_state:
    layout = layout.replace(opt_state=optimizer_state_shardings(
        state.opt_state, mesh, axis_name))
  return layout


def bytes_per_device(tree: Any) -> int:
  """Bytes of ``tree``'s arrays held by one device (its first shard each)."""
  return sum(leaf.addressable_shards[0].data.nbytes
             for leaf in jax.tree_util.tree_leaves(tree)
             if hasattr(leaf, "addressable_shards"))
