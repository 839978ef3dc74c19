"""An array laid out as the ops that read it need: the all-gather (or the
slice) happens on the array itself, in its own dtype.

An fp8 Dense product quantizes its kernel where the kernel lies (on each
device's FSDP shard) and hands the fp8 tensor to this op: the GEMM's
all-gather then carries one byte per weight, and the backward reads the
very tensor the forward gathered, so its two GEMMs share one gather.

Built on jax's ``custom_partitioning`` (as :mod:`jmp_lab.kernels.cast_transpose`
is). ``with_sharding_constraint`` cannot do this: the layout to gather to is
the consumer's (which axes the GEMM contracts locally), which only sharding
propagation knows. The op's Shardy rule gives its result factors of their
own, so the result takes its layout from its readers, and the partitioning
callback gathers (or slices) each device's block from the operand's layout
to that one. Without a mesh, on one device, or under ``vmap`` it is the
identity, and XLA lays the array out as before.
"""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def _axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec(sharding, ndim: int) -> list[tuple]:
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return [_axes(spec[d]) if d < len(spec) else () for d in range(ndim)]


def _relayout(x: jax.Array, mesh, source: list[tuple], target: list[tuple]
              ) -> jax.Array:
  """One device's block of ``x`` laid out by ``source``, re-laid out by
  ``target``: gathered over the axes a dimension leaves, then sliced by
  the axes it takes."""
  for dim, (have, want) in enumerate(zip(source, target)):
    if have == want:
      continue
    if have:
      x = jax.lax.all_gather(x, have, axis=dim, tiled=True)
    if want:
      parts, index = 1, 0
      for axis in want:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
        parts *= mesh.shape[axis]
      size = x.shape[dim] // parts
      x = jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)
  return x


def _partition(mesh, arg_shapes, result_shape):
  given, wanted = arg_shapes[0].sharding, result_shape.sharding
  if not (isinstance(given, NamedSharding)
          and isinstance(wanted, NamedSharding)):
    # No mesh to name the axes by (a jit without one): XLA lays it out.
    return mesh, lambda x: x, given, (given,)
  ndim = len(arg_shapes[0].shape)
  source, target = _spec(given, ndim), _spec(wanted, ndim)
  result = NamedSharding(mesh, PartitionSpec(
      *[(t if len(t) > 1 else t[0]) if t else None for t in target]))
  return (mesh, lambda x: _relayout(x, mesh, source, target), result,
          (given,))


def _rule(ndim: int) -> str:
  # The result's factors are its own: its layout comes from its consumers,
  # not from the operand's.
  names = [f"i{d}" for d in range(ndim)], [f"o{d}" for d in range(ndim)]
  return f"{' '.join(names[0])} -> {' '.join(names[1])}"


_OPS = {}


def _op(ndim: int):
  if ndim not in _OPS:
    op = custom_partitioning(lambda x: x)
    op.def_partition(partition=_partition,
                     infer_sharding_from_operands=lambda mesh, args, _: (
                         args[0].sharding),
                     sharding_rule=_rule(ndim))
    _OPS[ndim] = op
  return _OPS[ndim]


def laid_out_for_consumer(x: jax.Array) -> jax.Array:
  """``x``, its value unchanged, laid out on each device as the ops that
  read it need (gathered from ``x`` itself, in ``x``'s dtype).

  Not differentiable: :mod:`jmp_lab.fp8`'s Dense product calls it inside
  its forward rule, whose backward is written out.
  """
  if x.ndim == 0:
    return x
  op = _op(x.ndim)
  dispatch = jax.custom_batching.custom_vmap(op)

  @dispatch.def_vmap
  def _batched(axis_size, in_batched, x):
    del axis_size
    return x, in_batched[0]

  return dispatch(x)
