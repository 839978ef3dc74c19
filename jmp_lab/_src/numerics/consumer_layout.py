"""An array laid out as the ops that read it need: the all-gather (or the
slice) happens on the array itself, in its own dtype.

An fp8 product quantizes its kernel where the kernel lies (on each device's
FSDP shard) and hands the fp8 tensor to this op: the GEMM's all-gather then
carries one byte per weight, and the backward reads the very tensor the
forward gathered, so one gather serves the recomputed forward and the
input-gradient GEMM.

Built on jax's ``custom_partitioning`` (as :mod:`jmp_lab.kernels.cast_transpose`
is). ``with_sharding_constraint`` cannot do this: the layout to gather to is
the consumer's (which axes the GEMM contracts locally), which only sharding
propagation knows. The op's Shardy rule gives its result factors of their
own, so the result takes its layout from its readers, and the partitioning
callback gathers (or slices) each device's block from the operand's layout
to that one. Without named mesh axes (GSPMD's shardings), on one device,
inside a fully manual ``shard_map`` or under ``vmap`` it is the identity,
and XLA lays the array out as before.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jmp_lab import _compat
from jmp_lab.kernels.mesh import axes_per_dim, split_dims


def _relayout(x: jax.Array, mesh, source: list[tuple], target: list[tuple]
              ) -> jax.Array:
  """One device's block of ``x`` laid out by ``source``, re-laid out by
  ``target``: first gathered over every axis a dimension leaves, then
  sliced by the axes a dimension takes. (Slicing one dimension before
  gathering another could gather over an axis that already cut the first,
  joining blocks of different devices.)"""
  changed = [d for d, (have, want) in enumerate(zip(source, target))
             if have != want]
  for dim in changed:
    if source[dim]:
      x = jax.lax.all_gather(x, source[dim], axis=dim, tiled=True)
  for dim in changed:
    if target[dim]:
      # the device's index over the axes, major first, as all_gather orders
      size = x.shape[dim] // math.prod(mesh.shape[a] for a in target[dim])
      x = jax.lax.dynamic_slice_in_dim(
          x, jax.lax.axis_index(target[dim]) * size, size, axis=dim)
  return x


def _partition(mesh, arg_shapes, result_shape):
  ndim = len(arg_shapes[0].shape)
  given, wanted = arg_shapes[0].sharding, result_shape.sharding
  named = [_compat.named_sharding(s, mesh, ndim) for s in (given, wanted)]
  if getattr(mesh, "empty", True):
    # No mesh to name the axes by (a jit without one): XLA lays it out.
    return mesh, lambda x: x, given, (given,)
  if None in named:
    # A layout the mesh's axes cannot name: XLA split a dimension of fewer
    # blocks than devices by a factor no axis has (a weight whose shards
    # are not whole blocks). Gathered whole by XLA, then as the readers
    # want; nothing to do here.
    whole = NamedSharding(mesh, PartitionSpec())
    return mesh, lambda x: x, whole, (whole,)
  given, wanted = named
  source, target = axes_per_dim(given, ndim), axes_per_dim(wanted, ndim)
  return (mesh, lambda x: _relayout(x, mesh, source, target),
          split_dims(mesh, *target), (given,))


def _rule(ndim: int) -> str:
  # The result's factors are its own: its layout comes from its readers,
  # not from the operand's.
  operand = " ".join(f"i{d}" for d in range(ndim))
  result = " ".join(f"o{d}" for d in range(ndim))
  return f"{operand} -> {result}"


@functools.cache
def _dispatch(ndim: int):
  """The op for arrays of rank ``ndim``; under ``vmap``, the identity."""
  op = custom_partitioning(lambda x: x)
  # The shardings undecoded: jax's decoding raises for one the mesh's axes
  # cannot name (see _partition), where this op can gather instead.
  op.def_partition(partition=_partition,
                   infer_sharding_from_operands=lambda mesh, args, _: (
                       args[0].sharding),
                   decode_shardings=False,
                   sharding_rule=_rule(ndim))
  dispatch = jax.custom_batching.custom_vmap(op)

  @dispatch.def_vmap
  def _batched(axis_size, in_batched, x):
    del axis_size
    return x, in_batched[0]

  return dispatch


@jax.custom_jvp
def laid_out_for_consumer(x: jax.Array) -> jax.Array:
  """``x``, its value unchanged, laid out on each device as the ops that
  read it need (gathered from ``x`` itself, in ``x``'s dtype).

  An identity to autodiff (its tangent passes through, laid out by XLA),
  so a product that calls it in its forward rule can be differentiated
  twice.
  """
  return x if x.ndim == 0 else _dispatch(x.ndim)(x)


@laid_out_for_consumer.defjvp
def _tangent(primals, tangents):
  return laid_out_for_consumer(primals[0]), tangents[0]
