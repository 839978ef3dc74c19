"""Data-parallel layouts of a train state, with ZeRO-1 optimizer sharding.

Data parallelism in jax is a layout: the batch split over a mesh axis, the
params replicated, and XLA's partitioner inserting the gradient reductions.
ZeRO stage 1 also splits the optimizer state (fp32 master, remainders,
moments, the fused optimizer's flat buffers) over that axis, so each device
keeps 1/N of it: the partitioner then reduce-scatters the gradients into
each device's rows, updates them, and all-gathers the new params.

:func:`state_shardings` gives the ``NamedSharding`` of every leaf of a
:class:`~jmp_lab.TrainState` (or of any optimizer state);
``jmp_lab.make_train_step(loss_fn, state_sharding=..., batch_sharding=...)``
keeps that layout step after step (its in and out shardings).

Example::

  >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, jmp_lab
  >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  >>> mesh = Mesh(jax.devices()[:1], ("data",))
  >>> model = jmp_lab.linen.with_policy(nn.Dense(4), "mixed_bfloat16")
  >>> state = jmp_lab.TrainState.create(
  ...     apply_fn=model.apply, policy="mixed_bfloat16",
  ...     params=model.init(jax.random.key(0), jnp.ones((2, 8)))["params"],
  ...     tx=jmp_lab.mixed_precision(optax.adam(1e-3), policy="mixed_bfloat16",
  ...                                loss_scale=jmp_lab.NoOpLossScale()))
  >>> shardings = state_shardings(state, mesh)
  >>> shardings.params["kernel"].spec == P()     # params replicated
  True
  >>> shardings.opt_state.inner_state[0].mu["kernel"].spec == P("data")  # ZeRO-1
  True
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
