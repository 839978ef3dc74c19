"""Gradients marked as the gradients of a scaled loss
(:class:`ScaledGradients`), and how the optimizers take what they are
handed (:func:`received`).

jmp_lab's optimizers divide the gradients they are handed by the loss scale
only where they are marked: :func:`jmp_lab.scaled_value_and_grad` (and so
every jmp_lab train step) marks the gradients it returns. Plain gradients
(``jax.grad`` of the loss in a hand-written loop, Flax's
``TrainState.apply_gradients``, ``nnx.Optimizer.update``, Equinox) are the
gradients of an unscaled loss, and are taken as such: divided by 1, still
checked, a non-finite step still skipped. Where the optimizer was asked to
scale the loss (a loss scale other than ``NoOpLossScale``), a
:class:`~jmp_lab.precision.PrecisionWarning` says once per optimizer that
the loss was not scaled, and how to scale it. A loop therefore never trains
at ``1/scale`` in silence.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import jax

from jmp_lab._src.loss_scale import (DynamicLossScale, LossScale,
                                     NoOpLossScale, StaticLossScale)
from jmp_lab._src.user_warnings import PrecisionWarning, user_stacklevel


@jax.tree_util.register_pytree_with_keys_class
class ScaledGradients:
  """Gradients of the *scaled* loss, marked so for jmp_lab's optimizers.

  :func:`jmp_lab.scaled_value_and_grad` returns its gradients marked; a
  :func:`~jmp_lab.mixed_precision` or :func:`~jmp_lab.fused_adamw` update
  handed them divides them by the state's loss scale. Unmarked gradients
  are taken as those of the unscaled loss (see :mod:`jmp_lab.training`).

  A pytree node whose one child is the gradient tree: ``jax.tree.map``,
  ``lax.pmean``, ``jit`` and ``shard_map`` keep the mark, and it costs
  nothing at run time. Indexing gives a marked subtree
  (``grads["params"]``), as Flax's ``apply_gradients`` reads it; ``.grads``
  is the plain tree.

  Args:
    grads: the gradient tree (already marked gradients stay marked once).

  Example::

    >>> import jax, jax.numpy as jnp, jmp_lab
    >>> scale = jmp_lab.StaticLossScale(1024.0)
    >>> grads = jax.grad(lambda w: scale.scale(jnp.sum(w * w)))(jnp.ones(2))
    >>> marked = jmp_lab.ScaledGradients(grads)  # scaled by hand: say so
    >>> marked
    ScaledGradients(Array([2048., 2048.], dtype=float32))
    >>> jax.tree.map(lambda g: g / 2, marked).grads
    Array([1024., 1024.], dtype=float32)
  """

  __slots__ = ("grads",)

  def __init__(self, grads: Any):
    if isinstance(grads, ScaledGradients):
      grads = grads.grads
    self.grads = grads

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("grads"), self.grads),), None

  def tree_flatten(self):
    return (self.grads,), None

  @classmethod
  def tree_unflatten(cls, aux: Any, children: Any) -> "ScaledGradients":
    del aux
    # Bypasses __init__: the child may be a tracer, None or a sentinel
    # while jax transforms the tree.
    obj = object.__new__(cls)
    obj.grads = children[0]
    return obj

  def __getitem__(self, key: Any) -> "ScaledGradients":
    return ScaledGradients(self.grads[key])

  def __contains__(self, key: Any) -> bool:
    return key in self.grads

  def __repr__(self) -> str:
    return f"ScaledGradients({self.grads!r})"


def unmarked(grads: Any) -> Any:
  """The gradient tree, marked or not."""
  return grads.grads if isinstance(grads, ScaledGradients) else grads


def mark(grads: Any, per_argument: bool = False) -> Any:
  """``grads`` marked; with ``per_argument`` (``argnums`` a sequence, for
  which ``jax.value_and_grad`` returns a tuple with one gradient per
  argument) each element marked."""
  if per_argument:
    return tuple(ScaledGradients(g) for g in grads)
  return ScaledGradients(grads)


def received(update: Any, grads: Any, params: Any, loss_scale: LossScale,
             configured: LossScale, where: str) -> tuple[Any, LossScale]:
  """``(gradient tree, the loss scale to divide it by)``: the state's
  ``loss_scale`` for marked gradients; for plain ones ``NoOpLossScale()``
  (they are the unscaled loss's), with a warning, once per ``update``,
  where the optimizer's ``configured`` loss scale (concrete, where the
  state's is traced under ``jit``) asks for scaling."""
  if isinstance(grads, ScaledGradients):
    return grads.grads, loss_scale
  if _marked_through_nnx_state(grads, params):
    return grads["grads"], loss_scale
  if _asks_for_scaling(configured) and update not in _WARNED:
    _WARNED.add(update)
    warnings.warn(_unmarked_message(where, configured), PrecisionWarning,
                  stacklevel=user_stacklevel())
  return grads, NoOpLossScale()


def _marked_through_nnx_state(grads: Any, params: Any) -> bool:
  """Whether ``grads`` are marked gradients read through ``nnx.state``.

  Flax's ``nnx.Optimizer.update`` hands its transformation
  ``nnx.state(grads, wrt)``, which turns the :class:`ScaledGradients` node
  into a ``"grads"`` key: a mapping with that one key, holding a tree like
  ``params`` (whose own top level is not that key), is the mark.
  """
  if not (isinstance(grads, Mapping) and list(grads.keys()) == ["grads"]):
    return False
  if isinstance(params, Mapping) and list(params.keys()) == ["grads"]:
    return False
  return (jax.tree_util.tree_structure(grads["grads"])
          == jax.tree_util.tree_structure(params))


# The updates that have warned (by identity; an update is an optimizer).
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _asks_for_scaling(loss_scale: LossScale) -> bool:
  """Whether ``loss_scale`` scales the loss: any but ``NoOpLossScale`` and
  a concrete ``StaticLossScale(1.0)``."""
  if isinstance(loss_scale, NoOpLossScale):
    return False
  if isinstance(loss_scale, StaticLossScale) and not isinstance(
      loss_scale.loss_scale, jax.core.Tracer):
    return float(loss_scale.loss_scale) != 1.0
  return True


def _unmarked_message(where: str, loss_scale: LossScale) -> str:
  """What the warning about plain gradients says: what happened, why it
  matters under fp16, and the fix."""
  kind = ("a DynamicLossScale" if isinstance(loss_scale, DynamicLossScale)
          else f"a {type(loss_scale).__name__}")
  return (
      f"{where} was handed plain gradients, not gradients of the scaled "
      f"loss (jmp_lab.ScaledGradients), so it takes them as the gradients "
      f"of the unscaled loss: it does not divide them by its loss scale "
      f"({kind}), and still skips a non-finite step. But the loss was not "
      f"scaled, so fp16 gradients may underflow (small ones flush to zero), "
      f"which is what the loss scale is for. Differentiate the scaled loss "
      f"instead: loss, grads = jmp_lab.scaled_value_and_grad(loss_fn, "
      f"jmp_lab.current_loss_scale(opt_state))(params) (add value_and_grad="
      f"nnx.value_and_grad or equinox.filter_value_and_grad for NNX and "
      f"Equinox models) and hand those grads to the optimizer as they are; "
      f"gradients you scaled yourself go in as jmp_lab.ScaledGradients("
      f"grads). (If they did come from scaled_value_and_grad, the code in "
      f"between dropped the mark: pass them on as returned.)")
