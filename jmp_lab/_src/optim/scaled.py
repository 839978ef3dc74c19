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

import os
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab._src.policy import get_policy
from jmp_lab._src.loss_scale import (DynamicLossScale, LossScale,
                                     NoOpLossScale, StaticLossScale)
from jmp_lab._src.user_warnings import PrecisionWarning, user_stacklevel

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))  # jmp_lab/


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

  def __getattr__(self, name: str) -> Any:
    # Only for names the class lacks: a loop that edits a leaf by hand
    # (``grads.at``, ``grads.astype``) gets the way to do it.
    if name.startswith("__") or name == "grads":
      raise AttributeError(name)
    raise AttributeError(
        f"'ScaledGradients' object has no attribute {name!r}: it marks the "
        f"gradients of the scaled loss for jmp_lab's optimizers. Edit the "
        f"plain tree, grads.grads (e.g. jax.tree.map(f, grads.grads)), then "
        f"mark the result again with jmp_lab.ScaledGradients(tree); or map "
        f"over the marked tree directly: jax.tree.map(f, grads) keeps the "
        f"mark")

  def _refuse_arithmetic(self, *_: Any) -> Any:
    raise TypeError(
        "arithmetic on ScaledGradients (the marked gradients of the scaled "
        "loss) is not defined: use jax.tree.map(f, grads), which keeps the "
        "mark, or compute on the plain tree grads.grads and mark the result "
        "again with jmp_lab.ScaledGradients(tree)")

  __add__ = __radd__ = __sub__ = __rsub__ = _refuse_arithmetic
  __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse_arithmetic
  __neg__ = __pow__ = __matmul__ = _refuse_arithmetic


def accumulation_fix(fused: bool) -> str:
  """Where gradient accumulation goes with a jmp_lab optimizer: inside."""
  if fused:
    return ("jmp_lab.mixed_precision(optax.MultiSteps(optax.adamw(...), "
            "every_k_schedule=k), policy=...) (fused_adamw takes no inner "
            "transformation)")
  return ("jmp_lab.mixed_precision(optax.MultiSteps(inner, every_k_schedule=k)"
          ", policy=...)")


def accumulated_outside_message(where: str, fused: bool) -> str:
  """The warning for ``optax.MultiSteps`` around a jmp_lab optimizer.

  Legal, and almost certainly wrong: MultiSteps sums the *scaled*
  gradients, in the params' dtype, across loss-scale changes, and calls the
  optimizer once a window, so the dynamic scale adjusts k times more slowly
  and one overflowing micro-batch throws the window away. Inside
  (``mixed_precision(optax.MultiSteps(inner, k))``) each micro-batch is
  unscaled with its own scale and accumulated in fp32.
  """
  return (
      f"{where}: optax.MultiSteps wraps the jmp_lab optimizer, so it sums "
      f"the gradients of the scaled loss in the params' dtype across "
      f"loss-scale changes, and the optimizer sees one step per window: the "
      f"loss scale backs off k times more slowly and one overflowing "
      f"micro-batch drops the whole window (and the train step refuses it: "
      f"the marked gradients of the scaled loss do not fit MultiSteps' "
      f"accumulator). Put the accumulation inside: "
      f"{accumulation_fix(fused)}; each micro-batch is then unscaled "
      f"with its own scale and summed in fp32")


def warn_if_initialised_by_multisteps(where: str, fused: bool,
                                      caller: Any) -> None:
  """Warns when ``optax.MultiSteps.init`` is what calls a jmp_lab
  optimizer's ``init`` (``caller``: the frame that called it): the one
  moment the mistake can be seen whatever builds the state (Flax's own
  ``TrainState.create``, a hand-written loop), not only
  :class:`jmp_lab.TrainState`, which checks the state it builds."""
  frame = caller
  for _ in range(3):  # MultiSteps.init calls it through a helper or two
    if frame is None:
      return
    if isinstance(frame.f_locals.get("self"), optax.MultiSteps):
      if not _called_by_jmp_lab(frame.f_back):  # which warns by its name
        warnings.warn(accumulated_outside_message(where, fused), UserWarning,
                      stacklevel=user_stacklevel())
      return
    frame = frame.f_back


def warn_if_wrapped(where: str, fused: bool, loss_scale: LossScale) -> None:
  """The checks a jmp_lab optimizer's ``init`` makes of what wraps it:
  ``optax.MultiSteps`` around it, transformations chained before it. Call
  it from that ``init`` itself: the frames above it are what it reads."""
  caller = sys._getframe(2)  # 0: this function, 1: the init, 2: its caller
  warn_if_initialised_by_multisteps(where, fused, caller)
  warn_if_initialised_by_apply_if_finite(where, caller)
  warn_if_chained_after_others(where, fused, loss_scale, caller)


def warn_if_initialised_by_apply_if_finite(where: str, caller: Any) -> None:
  """Warns when ``optax.apply_if_finite``'s ``init`` (``caller``, the frame
  that called the jmp_lab optimizer's) initialises it. jmp_lab skips a
  non-finite step itself; around it, ``apply_if_finite`` tests the gradients
  of the scaled loss, and with half-precision params its two branches
  differ in dtype (jmp_lab's updates are fp32), which jax's ``cond``
  refuses at the first update with an error that names neither."""
  if not (caller is not None and caller.f_code.co_name == "init"
          and "optax" in caller.f_code.co_filename
          and "ApplyIfFiniteState" in caller.f_code.co_names):
    return
  warnings.warn(
      f"optax.apply_if_finite wraps {where}, which skips a non-finite step "
      f"itself (and backs off its loss scale): drop the wrapper and read "
      f"jmp_lab.skipped_steps(opt_state). Around it, apply_if_finite tests "
      f"the gradients of the scaled loss, and with half-precision params "
      f"its update fails in jax's cond (its branches differ in dtype: "
      f"jmp_lab's updates are fp32).",
      UserWarning, stacklevel=user_stacklevel())


def chained_after_others_message(where: str, position: int, fused: bool,
                                 loss_scale: LossScale) -> str:
  """The warning for transformations chained before a jmp_lab optimizer
  that scales the loss (see :func:`warn_if_chained_after_others`)."""
  example = ("jmp_lab.fused_adamw(..., max_grad_norm=...)" if fused else
             "jmp_lab.mixed_precision(optax.chain(optax.clip_by_global_norm("
             "1.0), optax.adamw(...)), policy=...)")
  return (
      f"{where} comes after {position} other transformation(s) in an "
      f"optax.chain: they run first, on the gradients of the scaled loss "
      f"(the loss times its loss scale, {_scale_in_words(loss_scale)}), "
      f"which only the jmp_lab optimizer divides back. A clip by global "
      f"norm there clips at the threshold divided by the scale, so it "
      f"clips every step: an SGD or momentum step then moves as many times "
      f"too little as the scale is large (Adam's step, nearly free of the "
      f"gradient's scale, hides it but for its eps). Put them inside: "
      f"{example}")


def _scale_in_words(loss_scale: LossScale) -> str:
  """``loss_scale``'s scale as the warning names it: its value where it
  is concrete, where it starts for a dynamic one."""
  value = getattr(loss_scale, "loss_scale", None)
  if value is None or isinstance(value, jax.core.Tracer):
    return f"as its {type(loss_scale).__name__} sets it"
  start = " at the start" if isinstance(loss_scale, DynamicLossScale) else ""
  return f"{float(value):g}{start}"


def warn_if_chained_after_others(where: str, fused: bool,
                                 loss_scale: LossScale, caller: Any) -> None:
  """Warns when ``optax.chain``'s (or ``optax.named_chain``'s) ``init``
  initialises a jmp_lab optimizer (``caller``: the frame that called its
  ``init``) that scales the loss after other
  transformations, at any depth of nested chains: they would see the
  gradients of the scaled loss (``optax.chain(optax.clip_by_global_norm(
  ...), jmp_lab.mixed_precision(optax.sgd(...)))`` under fp16 stepped
  32768 times too little, silently). The chain's ``init`` is the one
  moment its order can be seen, as :func:`warn_if_initialised_by_multisteps`
  does for ``MultiSteps``; a transformation that only rescales
  (``optax.scale``) or does nothing (``optax.identity``) would be harmless
  there, and stateless transformations cannot be told apart by their
  state, which is why this warns and does not refuse."""
  if not _asks_for_scaling(loss_scale):
    return
  position = _transformations_chained_before(caller)
  if position:
    warnings.warn(
        chained_after_others_message(where, position, fused, loss_scale),
        UserWarning, stacklevel=user_stacklevel())


# Frames between a chain's ``init`` and the ``init`` it calls: a nested
# chain adds two (its generator and its ``init_fn``), user code a few more.
_CHAIN_FRAMES_SEARCHED = 12


def _transformations_chained_before(frame: Any) -> int:
  """How many transformations run before the ``init`` whose caller is
  ``frame``, summed over every ``optax.chain``/``named_chain`` around it."""
  before = 0
  for _ in range(_CHAIN_FRAMES_SEARCHED):
    if frame is None:
      break
    before += _position_in_chain_init(frame) or 0
    frame = frame.f_back
  return before


def _position_in_chain_init(frame: Any) -> Optional[int]:
  """Which transformation an optax chain's ``init`` is initialising, when
  ``frame`` is ``optax.chain``'s generator (``tuple(fn(params) for fn in
  init_fns)``) or ``optax.named_chain``'s ``init_fn`` (a loop over its
  ``(name, tx)`` pairs); None for any other frame. optax's own local names
  are read: they are what its ``init`` holds, and no public API says."""
  if "optax" not in frame.f_code.co_filename:
    return None
  if frame.f_code.co_name == "<genexpr>":
    outer = frame.f_back
    init_fns = outer.f_locals.get("init_fns") if outer is not None else None
    if (outer is None or outer.f_code.co_name != "init_fn"
        or not isinstance(init_fns, tuple)):
      return None
    current = frame.f_locals.get("fn")
    return next((i for i, fn in enumerate(init_fns) if fn is current), None)
  transforms = frame.f_locals.get("transforms")
  if frame.f_code.co_name == "init_fn" and isinstance(transforms, list):
    name = frame.f_locals.get("name")
    return next((i for i, (n, _) in enumerate(transforms) if n == name),
                None)
  return None


def _called_by_jmp_lab(frame: Any) -> bool:
  """Whether jmp_lab's own code (``TrainState.create``,
  ``jmp_lab.nnx.Optimizer``) is among the few frames above ``frame``."""
  for _ in range(4):
    if frame is None:
      return False
    if frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
      return True
    frame = frame.f_back
  return False


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


def default_loss_scale(policy: Any) -> LossScale:
  """The loss scale a policy gets when none is given: dynamic for an fp16
  compute dtype, whose gradients underflow without one; none for bf16 (fp32's
  exponent range) and fp32, as ``torch.amp`` and Keras choose.

  >>> import jmp_lab
  >>> type(default_loss_scale("mixed_float16")).__name__
  'DynamicLossScale'
  >>> type(default_loss_scale("mixed_bfloat16")).__name__
  'NoOpLossScale'
  """
  if np.dtype(get_policy(policy).compute_dtype) == np.dtype(jnp.float16):
    return DynamicLossScale()
  return NoOpLossScale()
