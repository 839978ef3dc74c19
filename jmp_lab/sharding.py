"""Layouts of a train state: data parallel, ZeRO-1, FSDP and tensor parallel.

Data parallelism in jax is a layout: the batch split over a mesh axis, the
params replicated, and XLA's partitioner inserting the gradient reductions.
ZeRO stage 1 also splits the optimizer state (fp32 master, remainders,
moments, the fused optimizer's flat buffers) over that axis, so each device
keeps 1/N of it: the partitioner then reduce-scatters the gradients into
each device's rows, updates them, and all-gathers the new params.

FSDP and tensor parallelism shard the params themselves, as MaxText does:
Flax's partition boxes (``nn.with_partitioning``, or
``nn.with_logical_partitioning`` with logical axis rules) or given
shardings name each param's layout, and the optimizer state follows each
param's, with ZeRO-1 on top where a param is replicated along the data
axis (:func:`state_shardings`'s example; the distributed guide).

:func:`state_shardings` gives the ``NamedSharding`` of every leaf of a
:class:`~jmp_lab.TrainState` (or of any optimizer state);
:func:`nnx_optimizer_shardings` that of an NNX optimizer's state;
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

from jmp_lab._src.sharding import (
    bytes_per_device,
    nnx_optimizer_shardings,
    optimizer_state_shardings,
    replicated,
    state_shardings,
)

__all__ = [
    "bytes_per_device",
    "nnx_optimizer_shardings",
    "optimizer_state_shardings",
    "replicated",
    "state_shardings",
]
