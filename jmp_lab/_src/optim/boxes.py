"""Flax's partition boxes around params: the optimizers read the values.

Flax marks how a param is sharded by boxing it (``nn.with_partitioning``,
``nn.with_logical_partitioning``: an ``nn.Partitioned`` or
``nn.LogicallyPartitioned`` node around the array). MaxText's flow creates
the train state boxed, reads the partition specs off it
(``nn.get_partition_spec``), then unboxes it (``nn.unbox``) and trains on
the plain arrays. So a state built from boxed params must accept the
unboxed ones, and a state kept boxed must accept boxed ones:

* what an optimizer records about the params (their structure, shapes and
  dtypes; the fused optimizer's leaf layout) is recorded of the values, with
  the boxes stripped;
* ``mixed_precision``'s trees (the fp32 master, the inner state) are built by
  mapping over the params as given, so they keep the boxes (and
  ``nn.get_partition_spec`` of the state gives the master and moments their
  params' specs, as optax's own states do);
* the fused optimizer works on the values and boxes what it hands back the
  way the caller's tree was boxed.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from flax.core import meta


def is_box(x: Any) -> bool:
  """A Flax partition box (any ``flax.core.meta.AxisMetadata``)."""
  return isinstance(x, meta.AxisMetadata)


def unboxed(tree: Any) -> Any:
  """``tree`` with every partition box replaced by its value."""
  return meta.unbox(tree)


def variable_values(tree: Any) -> Any:
  """``tree`` with every NNX ``Variable`` replaced by its value.

  Flax's ``nnx.Optimizer`` initialises its transformation with the model's
  Variables (``nnx.state(model, wrt)``) and updates it with their values
  (``nnx.as_pure``): an optimizer builds its state from the values, so the
  two agree."""
  if not any(isinstance(x, nnx.Variable) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable))):
    return tree
  return nnx.as_pure(tree)


def has_boxes(tree: Any) -> bool:
  return any(is_box(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_box))


def boxed_like(like: Any, values: Any) -> Any:
  """``values`` (an unboxed tree) boxed as ``like`` is: each box of ``like``
  around the value at its place (``like`` unboxed has ``values``' shape)."""
  if not has_boxes(like):
    return values
  treedef = jax.tree_util.tree_structure(like, is_leaf=is_box)
  boxes = treedef.flatten_up_to(like)
  flat_values = treedef.flatten_up_to(values)
  return treedef.unflatten([
      box.replace_boxed(value) if is_box(box) else value
      for box, value in zip(boxes, flat_values)])
