"""The two state layouts of the fused optimizer: flat buffers, or the leaves.

:class:`TreeLayout` keeps the master and moments as trees like the params,
updated by the multi-tensor kernel (:mod:`.multi_tensor`) with no packing.

:class:`FlatLayout`: the fused update streams the master weights and Adam moments as persistent
2-D buffers of shape ``(rows, LANES)``: TMA copies on Hopper move at most 256
elements per dimension, and a 2-D tile keeps every backend's block shape a
power of two. The number of rows is padded so that every kernel program gets
the same whole number of ``BLOCK_ROWS x LANES`` blocks.

Leaves are laid out weight-decayed first, then the rest, so the kernel learns
whether an element decays from one boundary index instead of reading a mask
buffer (which would cost a byte per parameter).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels import pytrees

LANES = 256
BLOCK_ROWS = 8
BLOCK_ELEMENTS = LANES * BLOCK_ROWS
# Programs for the persistent Mosaic grid: an H100/H200 has 132 SMs.
MAX_PROGRAMS = 132


def num_programs(size: int) -> int:
  """Kernel programs for ``size`` elements: one per SM, fewer if tiny."""
  return max(1, min(MAX_PROGRAMS, math.ceil(size / BLOCK_ELEMENTS)))


def padded_size(size: int, shards: int = 1) -> int:
  """``size`` padded to whole kernel blocks for every program, in each of
  ``shards`` equal row ranges."""
  quantum = BLOCK_ELEMENTS * num_programs(size) * shards
  return max(quantum, math.ceil(size / quantum) * quantum)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where each trainable leaf lives in the flat buffers (static, no leaves).

  Attributes:
    treedef: the params' tree structure.
    trainable: per leaf (in tree order), whether it is a floating param.
    shapes: per leaf, its shape.
    offsets: per leaf, its start in the flat buffer (None if not trainable).
    size: trainable elements; ``decay_boundary``: elements that decay.
    padded: the flat length, a multiple of ``BLOCK_ELEMENTS * programs *
      shards``.
    param_dtype: the dtype of the params' floating leaves.
    shards: how many equal row ranges the buffers split into (ZeRO-1 inside
      ``shard_map``: each device updates ``rows // shards`` rows).
  """

  treedef: Any
  trainable: tuple[bool, ...]
  shapes: tuple[tuple[int, ...], ...]
  offsets: tuple[Optional[int], ...]
  size: int
  decay_boundary: int
  padded: int
  param_dtype: np.dtype
  shards: int = 1

  @property
  def rows(self) -> int:
    return self.padded // LANES

  @property
  def local_rows(self) -> int:
    """The rows of one shard."""
    return self.rows // self.shards

  @property
  def programs(self) -> int:
    return num_programs(self.size)

  def master_tree(self, master: Any) -> Any:
    """The fp32 master buffer as a tree (non-trainable leaves None)."""
    return unpack(self, master)


jax.tree_util.register_static(FlatLayout)


@dataclasses.dataclass(frozen=True)
class TreeLayout:
  """The trainable leaves of the params, kept as they are (static).

  Attributes:
    treedef: the params' tree structure.
    trainable: per leaf (in tree order), whether it is a floating param.
    decays: per leaf, whether it is weight-decayed (False if not trainable).
    param_dtype: the dtype of the params' floating leaves.
  """

  treedef: Any
  trainable: tuple[bool, ...]
  decays: tuple[bool, ...]
  param_dtype: np.dtype

  def leaves(self, tree: Any) -> list:
    """The trainable leaves of ``tree`` (a params-like tree), in order."""
    return [x for x, keep in zip(self.treedef.flatten_up_to(tree),
                                 self.trainable) if keep]

  def tree(self, leaves: list, rest: Any = None) -> Any:
    """The tree of trainable ``leaves``; the others come from ``rest`` (or
    are None)."""
    rest_leaves = (self.treedef.flatten_up_to(rest) if rest is not None
                   else [None] * len(self.trainable))
    it = iter(leaves)
    return self.treedef.unflatten([next(it) if keep else other for keep, other
                                   in zip(self.trainable, rest_leaves)])

  @property
  def trainable_decays(self) -> tuple[bool, ...]:
    return tuple(d for d, keep in zip(self.decays, self.trainable) if keep)

  def master_tree(self, master: Any) -> Any:
    """The fp32 master as a tree: it is one already."""
    return master


jax.tree_util.register_static(TreeLayout)


def make_tree_layout(params: Any, decay_mask: Any, param_dtype) -> TreeLayout:
  """The :class:`TreeLayout` of ``params`` (see :func:`make_layout`)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  masks = treedef.flatten_up_to(_broadcast_mask(decay_mask, params))
  trainable = tuple(pytrees.is_floating_array(x) for x in leaves)
  decays = tuple(bool(m) and t for m, t in zip(masks, trainable))
  return TreeLayout(treedef, trainable, decays, np.dtype(param_dtype))


def make_layout(params: Any, decay_mask: Any, param_dtype,
                shards: int = 1) -> FlatLayout:
  """Lays out ``params``' floating leaves, weight-decayed leaves first.

  Args:
    params: the params tree.
    decay_mask: a tree of bools with the params' structure (True: decay).
    param_dtype: the dtype of the params' floating leaves.
    shards: split the rows into this many equal ranges of whole kernel
      blocks (see ``FlatLayout.shards``).
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  masks = treedef.flatten_up_to(_broadcast_mask(decay_mask, params))
  trainable = tuple(pytrees.is_floating_array(x) for x in leaves)
  shapes = tuple(tuple(np.shape(x)) for x in leaves)
  offsets: list[Optional[int]] = [None] * len(leaves)
  cursor = 0
  for want_decay in (True, False):
    for i, (leaf_trainable, mask) in enumerate(zip(trainable, masks)):
      if leaf_trainable and bool(mask) == want_decay:
        offsets[i] = cursor
        cursor += math.prod(shapes[i])
    if want_decay:
      boundary = cursor
  return FlatLayout(treedef, trainable, shapes, tuple(offsets), cursor,
                    boundary, padded_size(cursor, shards), np.dtype(param_dtype),
                    shards)


def _broadcast_mask(mask: Any, params: Any) -> Any:
  """A bool per params leaf, from a mask that is the params' tree or a prefix
  of it (as optax accepts)."""
  try:
    return jax.tree_util.tree_map(
        lambda m, sub: jax.tree_util.tree_map(lambda _: m, sub), mask, params)
  except ValueError:
    mismatch = pytrees.first_structure_mismatch(params, mask)
    raise ValueError(
        f"the weight-decay mask must have the params' structure, or be a "
        f"prefix of it, with a bool per leaf: {mismatch}") from None


def pack(layout: FlatLayout, tree: Any, dtype) -> jax.Array:
  """The trainable leaves of ``tree`` as one padded ``(rows, LANES)`` buffer."""
  leaves = layout.treedef.flatten_up_to(tree)
  order = sorted((off, i) for i, off in enumerate(layout.offsets)
                 if off is not None)
  parts = [jnp.ravel(leaves[i]).astype(dtype) for _, i in order]
  parts.append(jnp.zeros((layout.padded - layout.size,), dtype))
  return jnp.concatenate(parts).reshape(layout.rows, LANES)


def unpack(layout: FlatLayout, flat: jax.Array, rest: Any = None, *,
           leaves_per_fusion: Optional[int] = None) -> Any:
  """The tree held in ``flat``; non-trainable leaves come from ``rest``.

  Without ``rest`` the non-trainable leaves are None.

  With ``leaves_per_fusion``, every that many leaves read ``flat`` through an
  ``optimization_barrier`` of their own (free at run time). XLA:GPU fuses all
  consumers of one buffer into one multi-output kernel: for a model with
  dozens of leaves that kernel needs more than 255 registers and spills
  (seen compiling GPT-2-small for an H100). Separate values keep each group's
  kernel small.
  """
  flat = flat.reshape(-1)
  rest_leaves = (layout.treedef.flatten_up_to(rest) if rest is not None
                 else [None] * len(layout.shapes))
  leaves = []
  source, used = flat, 0
  for offset, shape, other in zip(layout.offsets, layout.shapes, rest_leaves):
    if offset is None:
      leaves.append(other)
      continue
    if leaves_per_fusion and used == leaves_per_fusion:
      source, used = jax.lax.optimization_barrier(flat), 0
    used += 1
    leaves.append(source[offset:offset + math.prod(shape)].reshape(shape))
  return layout.treedef.unflatten(leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def view(layout: FlatLayout, flat: jax.Array) -> Any:
  """:func:`unpack` for a model that reads its params from ``flat``.

  The same values; the gradient with respect to ``flat`` is assembled by
  :func:`pack` (one concatenation) instead of autodiff's sum of one padded
  buffer per leaf, which XLA:GPU compiles into a kernel that spills registers
  for a model with hundreds of leaves (seen on GPT-2-small for an H100).
  """
  return unpack(layout, flat)


def _view_fwd(layout, flat):
  # An empty array carries the dtype: residuals must be JAX values.
  return unpack(layout, flat), jnp.zeros((0,), flat.dtype)


def _view_bwd(layout, dtype_carrier, cotangents):
  dtype = dtype_carrier.dtype
  cotangents = jax.tree_util.tree_map(
      lambda c, shape: jnp.zeros(shape, dtype) if c is None else c,
      cotangents, _shapes_tree(layout), is_leaf=lambda x: x is None)
  return (pack(layout, cotangents, dtype),)


def _shapes_tree(layout: FlatLayout) -> Any:
  return layout.treedef.unflatten(list(layout.shapes))


view.defvjp(_view_fwd, _view_bwd)


__all__ = [
    "BLOCK_ELEMENTS",
    "BLOCK_ROWS",
    "LANES",
    "MAX_PROGRAMS",
    "FlatLayout",
    "make_layout",
    "make_tree_layout",
    "num_programs",
    "pack",
    "padded_size",
    "TreeLayout",
    "unpack",
    "view",
]
