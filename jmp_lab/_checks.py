"""Private checks and tree plumbing shared by both optimizers and the step.

Everything here runs at trace time (shapes, dtypes, types), never on device
values, so none of it costs a host sync. The public modules call these so that
every entry point refuses the same mistake with the same message.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab.kernels import pytrees
from jmp_lab._src.policy import Policy

# --------------------------------------------------------------------------
# Arguments of the public constructors.
# --------------------------------------------------------------------------


def check_transformation(value: Any, argument: str) -> None:
  """Raises TypeError unless ``value`` is an optax GradientTransformation."""
  if isinstance(value, optax.GradientTransformation) or (
      callable(getattr(value, "init", None))
      and callable(getattr(value, "update", None))):
    return
  hint = ""
  if callable(value):
    name = getattr(value, "__qualname__", getattr(value, "__name__", "it"))
    hint = (f"; {name} looks like an optax factory passed uncalled: call it, "
            f"e.g. optax.adam(1e-3)")
  raise TypeError(
      f"{argument} must be an optax GradientTransformation (such as "
      f"optax.adamw(1e-3)), got {type(value).__name__} {value!r}{hint}")


def concrete_real(value: Any, argument: str) -> float:
  """``value`` as a Python float; TypeError for non-numbers and tracers."""
  if isinstance(value, (bool, np.bool_)) or not (
      isinstance(value, (int, float, np.number))
      or (hasattr(value, "dtype") and np.ndim(value) == 0
          and jnp.issubdtype(value.dtype, jnp.number))):
    raise TypeError(f"{argument} must be a real number, got "
                    f"{type(value).__name__} {value!r}")
  try:
    return float(value)
  except jax.errors.ConcretizationTypeError:
    raise TypeError(f"{argument} must be a concrete number, not a traced "
                    f"value; pass a schedule for a changing value") from None


def check_finite_in(value: Any, argument: str, *, low: float, high: float,
                    low_open: bool = False, high_open: bool = False) -> float:
  """Checks that ``value`` is a finite real in the given interval."""
  x = concrete_real(value, argument)
  above = x > low if low_open else x >= low
  below = x < high if high_open else x <= high
  if not (math.isfinite(x) and above and below):
    interval = (("(" if low_open else "[") + f"{low:g}, {high:g}" +
                (")" if high_open else "]"))
    raise ValueError(f"{argument} must be finite and in {interval}, got "
                     f"{value!r}")
  return x


# --------------------------------------------------------------------------
# Params, gradients and the optimizer state that must match them.
# --------------------------------------------------------------------------


def check_loss(loss: Any, contract: str) -> None:
  """A loss_fn's loss must be a floating scalar (``contract`` says what the
  loss_fn must return)."""
  if not (pytrees.is_floating_value(loss) and jnp.ndim(loss) == 0):
    raise TypeError(f"{contract}; got a loss of {pytrees.leaf_description(loss)}")


def checked_metrics(metrics: Any, contract: str) -> dict:
  """A loss_fn's metrics as a dict (None: none)."""
  if metrics is None:
    return {}
  if not isinstance(metrics, Mapping):
    raise TypeError(f"{contract}; got metrics of type {type(metrics).__name__}")
  return dict(metrics)


def model_policy(apply_fn: Any) -> Optional[Policy]:
  """The policy of a model's apply function: ``jmp_lab.linen.with_policy(
  ...).apply`` or a :func:`jmp_lab.autocast` function; None otherwise."""
  for owner in (getattr(apply_fn, "__self__", None), apply_fn):
    policy = getattr(owner, "policy", None)
    if isinstance(policy, Policy):
      return policy
  return None


def check_policies_agree(policies: Sequence[tuple[str, Optional[Policy]]],
                         where: str) -> None:
  """Raises ValueError, naming both, when two of the named policies differ
  in their param or compute dtype (None: unknown, not checked)."""
  known = [(name, p) for name, p in policies if p is not None]
  for name, policy in known[1:]:
    first_name, first = known[0]
    if (policy.param_dtype, policy.compute_dtype) != (
        first.param_dtype, first.compute_dtype):
      raise ValueError(
          f"{where}: {first_name} policy ({first}) and {name} policy "
          f"({policy}) disagree; give every one the same policy (e.g. one "
          f"jmp_lab.get_policy(...) object)")


def check_trainable_params(params: Any) -> None:
  """Refuses integer or boolean leaves among a train state's params: the
  step differentiates every param, and jax cannot differentiate those."""
  for path, leaf in pytrees.leaves_with_paths(params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"TrainState.create's params hold {pytrees.leaf_description(leaf)} "
          f"at {path}: the train step differentiates every param, and "
          f"integer or boolean leaves cannot be differentiated. Keep them "
          f"in model_state (a step counter, a mask), or out of the state")


def check_params(params: Any, policy: Policy) -> None:
  """Raises if a floating param is not in ``policy.param_dtype``."""
  for path, leaf in pytrees.leaves_with_paths(params):
    if pytrees.is_floating_array(leaf) and leaf.dtype != policy.param_dtype:
      raise ValueError(
          f"param {path} is {pytrees.leaf_description(leaf)} but the policy's "
          f"param_dtype is {policy.param_dtype.name}; cast the params with "
          f"policy.cast_to_param(params) first")


def check_grads(grads: Any, params: Any) -> None:
  """Raises if ``grads`` does not match ``params`` leaf for leaf."""
  mismatch = pytrees.first_structure_mismatch(params, grads)
  if mismatch is not None:
    raise ValueError(f"grads do not match params: {mismatch}")
  for (path, p), (_, g) in zip(pytrees.leaves_with_paths(params),
                               pytrees.leaves_with_paths(grads)):
    if jnp.shape(p) != jnp.shape(g):
      raise ValueError(
          f"gradient {path} has shape {jnp.shape(g)} but its param has shape "
          f"{jnp.shape(p)}")
    if pytrees.is_floating_array(p):
      if jnp.result_type(g) != p.dtype:
        raise ValueError(
            f"gradient {path} is {pytrees.leaf_description(g)} but its param is "
            f"{pytrees.leaf_description(p)}; gradients must be in the param "
            f"dtype (differentiate the scaled loss with respect to the params)")
    elif pytrees.is_floating_value(g):
      raise ValueError(
          f"gradient {path} is floating ({pytrees.leaf_description(g)}) but its "
          f"param is {pytrees.leaf_description(p)}, which is not trainable")
