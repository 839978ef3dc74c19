"""What every jmp_lab train step does around the model: the loss contract,
the update (and its new-params fast path), fp8's scaling-state bookkeeping
and the metrics. ``jmp_lab.train_step`` and ``jmp_lab.nnx.train_step`` only
add their framework's way of differentiating and holding state.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import jax
import optax

from jmp_lab import _checks
from jmp_lab._src.numerics import fp8_quantize, fp8_state
from jmp_lab._src.optim import scaled
from jmp_lab._src.optim.scaled import ScaledGradients
from jmp_lab._src.optim.updates import WritesParams
from jmp_lab._src.optim.states import (FusedAdamWState, State, find_state,
                                      last_step_applied)
from jmp_lab._src.loss_scale import select_tree
from jmp_lab._src.user_warnings import user_stacklevel

#: The name scope of the optimizer update inside a train step: compiled
#: reports (``CompiledReport.scope``) find its kernels and bytes by it.
UPDATE_SCOPE = "jmp_lab_update"


def jmp_lab_state(opt_state: Any, where: str) -> State:
  """The jmp_lab state in ``opt_state``; a TypeError naming the fix when the
  optimizer is not a jmp_lab one, and a warning when it is accumulated
  from outside (:func:`warn_if_accumulated_outside`)."""
  try:
    state = find_state(opt_state)
  except ValueError:
    raise TypeError(
        f"{where}'s tx must be a jmp_lab optimizer (jmp_lab.mixed_precision"
        f"(...) or jmp_lab.fused_adamw(...)), which keeps the loss scale and "
        f"skips non-finite steps; got one whose state is a "
        f"{type(opt_state).__name__}") from None
  warn_if_accumulated_outside(opt_state, where)
  return state


def _holds_jmp_lab_state(tree: Any) -> bool:
  try:
    find_state(tree)
  except ValueError:
    return False
  return True


def warn_if_accumulated_outside(opt_state: Any, where: str) -> None:
  """Warns when ``optax.MultiSteps`` wraps the jmp_lab optimizer (see
  :func:`scaled.accumulated_outside_message`)."""
  if not _accumulated_outside(opt_state):
    return
  warnings.warn(scaled.accumulated_outside_message(
      where, _is_fused(opt_state)), UserWarning, stacklevel=user_stacklevel())


def _is_fused(opt_state: Any) -> bool:
  return isinstance(find_state(opt_state), FusedAdamWState)


def _accumulated_outside(opt_state: Any) -> bool:
  """Whether an ``optax.MultiSteps`` wraps the jmp_lab optimizer."""
  is_multisteps = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
  return any(is_multisteps(node) and _holds_jmp_lab_state(node.inner_opt_state)
             for node in jax.tree_util.tree_leaves(opt_state,
                                                   is_leaf=is_multisteps))


def update(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
           params: Any, also_finite: Any = None, **extra_args
           ) -> tuple[Any, Any]:
  """``(new params, new opt_state)`` from the gradients of the scaled loss.

  ``fused_adamw`` hands back the params its kernel wrote (no updates tree
  and no ``apply_updates`` pass; the same values, bit for bit); any other
  optimizer goes through optax's ``update`` and ``apply_updates``.
  """
  if isinstance(grads, ScaledGradients) and _accumulated_outside(opt_state):
    # MultiSteps pairs the gradients with its accumulator (a tree like the
    # params): jax's own error would name a pytree mismatch.
    raise TypeError(
        f"optax.MultiSteps wraps the jmp_lab optimizer, and the gradients of "
        f"the scaled loss (jmp_lab.ScaledGradients) cannot go through its "
        f"accumulator, which would sum them in the params' dtype across "
        f"loss-scale changes. Put the accumulation inside: "
        f"{scaled.accumulation_fix(_is_fused(opt_state))}")
  kwargs = dict(extra_args)
  if also_finite is not None:
    kwargs["also_finite"] = also_finite
  # Named, so that compiled reports can find the update's kernels.
  with jax.named_scope(UPDATE_SCOPE):
    if isinstance(tx.update, WritesParams) and not extra_args:
      return tx.update.new_params(grads, opt_state, params,
                                  also_finite=also_finite)
    updates, new_opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), new_opt_state


def fp8_observed(old_meta: Optional[Any], observed: Optional[Any]
                 ) -> Optional[jax.Array]:
  """Whether the step's observed fp8 amaxes are finite (None without fp8):
  the optimizer's gate skips the step otherwise (:func:`fp8_quantize.observed_finite`)."""
  if old_meta is None or not jax.tree_util.tree_leaves(observed):
    return None
  return fp8_quantize.observed_finite(observed)


def fp8_after_step(old_meta: Any, observed: Any, step: Any,
                   applied: jax.Array) -> Any:
  """The fp8 scaling state after a step: the amaxes written into the
  histories, kept as they were on a skipped step, and the scales computed
  from the kept histories (``fp8_state.write_amaxes``, then ``fp8_state.rescale``)."""
  written = fp8_state.write_amaxes(old_meta, observed, step)
  return fp8_state.rescale(select_tree(applied, written, old_meta), applied)


def metrics(own: dict, loss: Any, loss_scale: Any, opt_state: Any,
            skipped: Any) -> dict:
  """The step's metrics: ``loss_fn``'s own, and ``loss``, the
  ``loss_scale`` used, ``grads_finite`` and ``skipped_steps``."""
  own = dict(own)
  own.update(loss=loss, loss_scale=loss_scale.loss_scale,
             grads_finite=last_step_applied(opt_state), skipped_steps=skipped)
  return own


def loss_and_aux(out: Any, contract: str) -> tuple[Any, Any]:
  """``(loss, aux)`` from what a ``loss_fn`` returned (a loss, or a pair);
  a TypeError quoting ``contract`` otherwise."""
  if isinstance(out, tuple):
    if len(out) != 2:
      raise TypeError(f"{contract}; got a tuple of {len(out)} items")
    loss, aux = out
  else:
    loss, aux = out, None
  _checks.check_loss(loss, contract)
  return loss, aux
