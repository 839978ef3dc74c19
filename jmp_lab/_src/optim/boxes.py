"""Flax's layout metadata around params, which the optimizer states keep.

Flax marks how a param is sharded by wrapping it: linen boxes it
(``nn.with_partitioning``, ``nn.with_logical_partitioning``: an
``nn.Partitioned`` or ``nn.LogicallyPartitioned`` node around the array),
NNX keeps the metadata on the ``nnx.Variable`` (``sharding_names``,
``out_sharding``). Each framework's own layout flow reads it off the train
state: Flax's guide (``nn.get_partition_spec(jax.eval_shape(init))``),
MaxText (the same, then ``nn.unbox``), NNX
(``nnx.get_partition_spec(nnx.state(optimizer, nnx.OptState))``). optax's
states keep it because optax maps over the params as given; jmp_lab's do
the same, so those flows shard them as they shard optax's:

* what an optimizer records about the params (their structure, shapes and
  dtypes; the fused optimizer's leaf layout) is recorded of the values, and
  the kernels run on the values;
* every state array shaped like the params (master, moments, remainders) is
  wrapped as its param is (:func:`wrapped_like_params`), and an update
  hands back its new state wrapped as the state it was given was;
* a state built wrapped accepts unwrapped params (MaxText's unboxed
  training) and wrapped ones (Flax's guide trains on the boxed state).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import meta

from jmp_lab.kernels import quantized


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


def is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _is_wrapper(x: Any) -> bool:
  return is_box(x) or is_variable(x)


def _has_wrappers(tree: Any) -> bool:
  return any(_is_wrapper(x) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=_is_wrapper))


def _rewrapped(wrapper: Any, value: Any) -> Any:
  """``value`` in a wrapper like ``wrapper`` (its type and metadata).

  Rebuilt through the wrapper's pytree structure, as ``jax.tree.map`` (and
  so optax) rebuilds it: an NNX Variable with an ``out_sharding`` cannot be
  constructed outside a mesh, but it can be unflattened."""
  if not hasattr(value, "shape") or not _is_wrapper(wrapper):
    return value  # a hole: None, optax.masked's MaskedNode
  if quantized.is_quantized(value):
    # Its arrays each wrapped (the scales have the param's rank), the
    # NamedTuple above them, as optax's states are: NNX rebuilds a
    # Variable's value, and a NamedTuple inside one comes back a State.
    return quantized.QuantizedMoment(*(_rewrapped(wrapper, v)
                                       for v in value))
  rebuilt = jax.tree_util.tree_structure(wrapper).unflatten([value])
  return _as_stored(rebuilt) if is_variable(rebuilt) else rebuilt


def _as_stored(variable: nnx.Variable) -> nnx.Variable:
  """A copy of a param that a policy reads in its compute dtype, as state:
  the user's Variable class, without the policy's read metadata (an fp32
  master or moment is never read in half). The policy's classes name both
  (``_jmp_lab_stored_class``, ``_jmp_lab_read_metadata``)."""
  policy_class = type(variable)
  stored = getattr(policy_class, "_jmp_lab_stored_class", None)
  if stored is None:
    return variable
  variable.__class__ = stored
  metadata = dict(variable.get_metadata())
  metadata.pop(policy_class._jmp_lab_read_metadata, None)
  variable.set_metadata(metadata)
  return variable


def boxed_like(like: Any, values: Any) -> Any:
  """``values`` (an unwrapped tree) wrapped as ``like`` is: each linen box
  or NNX Variable of ``like`` around the value at its place (``like``
  unwrapped has ``values``' structure; a None value stays None)."""
  if not _has_wrappers(like):
    return values
  treedef = jax.tree_util.tree_structure(like, is_leaf=_is_wrapper)
  return treedef.unflatten([
      _rewrapped(wrapper, value) for wrapper, value in
      zip(treedef.flatten_up_to(like), treedef.flatten_up_to(values))])


def wrapped_like_params(state: Any, params: Any) -> Any:
  """``state`` (built from the params' values) with every subtree shaped
  like the params (the master, moments, remainders; None where a leaf has
  none) wrapped as ``params`` are: linen's boxes, NNX's Variables.

  Example::

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> params = {"w": nn.LogicallyPartitioned(jnp.ones((4, 2)),
    ...                                        ("embed", "mlp"))}
    >>> state = {"mu": {"w": jnp.zeros((4, 2))}, "count": jnp.zeros(())}
    >>> nn.get_partition_spec(wrapped_like_params(state, params))["mu"]["w"]
    P('embed', 'mlp')
  """
  if not _has_wrappers(params):
    return state
  values = values_of(params)
  treedef = jax.tree_util.tree_structure(values)
  shapes = [np.shape(x) for x in treedef.flatten_up_to(values)]
  if treedef.num_nodes == 1:  # a lone array: nothing tells a subtree apart
    return state

  def param_shaped(node: Any) -> bool:
    try:
      flat = treedef.flatten_up_to(node)
    except (ValueError, TypeError):
      return False
    def hole(x):  # None, or an empty node (optax.masked's MaskedNode)
      return x is None or not jax.tree_util.tree_leaves(x)
    return any(not hole(x) for x in flat) and all(
        hole(x) or (hasattr(x, "shape") and tuple(x.shape) == shape)
        for x, shape in zip(flat, shapes))

  return jax.tree_util.tree_map(
      lambda node: boxed_like(params, node) if param_shaped(node) else node,
      state, is_leaf=param_shaped)


def values_of(tree: Any) -> Any:
  """``tree`` with linen's boxes and NNX's Variables replaced by their
  values."""
  return variable_values(unboxed(tree))


def rewrapped_state(given: Any, new: Any) -> Any:
  """``new`` (an unwrapped state) wrapped as the state ``given`` to an
  update was (linen's boxes, NNX's Variables)."""
  if not _has_wrappers(given):
    return new
  return boxed_like(given, new)
