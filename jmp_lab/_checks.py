"""Private checks and tree plumbing shared by both optimizers and the step.

Everything here runs at trace time (shapes, dtypes, types), never on device
values, so none of it costs a host sync. The public modules call these so that
every entry point refuses the same mistake with the same message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab import _tree
from jmp_lab.loss_scale import LossScale, all_finite
from jmp_lab.policy import Policy

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


def check_loss_scale(value: Any, argument: str = "loss_scale") -> None:
  """Raises TypeError unless ``value`` is a jmp_lab LossScale."""
  if isinstance(value, LossScale):
    return
  hint = ""
  if isinstance(value, (int, float, np.number)) or (
      hasattr(value, "shape") and np.ndim(value) == 0):
    hint = f"; to scale by a fixed number, use jmp_lab.StaticLossScale({value!r})"
  raise TypeError(
      f"{argument} must be a jmp_lab loss scale (NoOpLossScale(), "
      f"StaticLossScale(...) or DynamicLossScale()), got "
      f"{type(value).__name__} {value!r}{hint}")


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
  if not (_tree.is_floating_value(loss) and jnp.ndim(loss) == 0):
    raise TypeError(f"{contract}; got a loss of {_tree.leaf_description(loss)}")


def checked_metrics(metrics: Any, contract: str) -> dict:
  """A loss_fn's metrics as a dict (None: none)."""
  if metrics is None:
    return {}
  if not isinstance(metrics, Mapping):
    raise TypeError(f"{contract}; got metrics of type {type(metrics).__name__}")
  return dict(metrics)


def optimizer_policy(tx: Any) -> Optional[Policy]:
  """The policy a jmp_lab optimizer (``mixed_precision``, ``fused_adamw``)
  was built with; None for any other transformation."""
  policy = getattr(getattr(tx, "update", None), "policy", None)
  return policy if isinstance(policy, Policy) else None


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
  for path, leaf in _tree.leaves_with_paths(params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"TrainState.create's params hold {_tree.leaf_description(leaf)} "
          f"at {path}: the train step differentiates every param, and "
          f"integer or boolean leaves cannot be differentiated. Keep them "
          f"in model_state (a step counter, a mask), or out of the state")


def keeps_master_copy(policy: Policy) -> bool:
  """Whether params of ``policy.param_dtype`` need a separate fp32 master."""
  return policy.param_dtype.itemsize < 4


def check_params(params: Any, policy: Policy) -> None:
  """Raises if a floating param is not in ``policy.param_dtype``."""
  for path, leaf in _tree.leaves_with_paths(params):
    if _tree.is_floating_array(leaf) and leaf.dtype != policy.param_dtype:
      raise ValueError(
          f"param {path} is {_tree.leaf_description(leaf)} but the policy's "
          f"param_dtype is {policy.param_dtype.name}; cast the params with "
          f"policy.cast_to_param(params) first")


def check_grads(grads: Any, params: Any) -> None:
  """Raises if ``grads`` does not match ``params`` leaf for leaf."""
  mismatch = _tree.first_structure_mismatch(params, grads)
  if mismatch is not None:
    raise ValueError(f"grads do not match params: {mismatch}")
  for (path, p), (_, g) in zip(_tree.leaves_with_paths(params),
                               _tree.leaves_with_paths(grads)):
    if jnp.shape(p) != jnp.shape(g):
      raise ValueError(
          f"gradient {path} has shape {jnp.shape(g)} but its param has shape "
          f"{jnp.shape(p)}")
    if _tree.is_floating_array(p):
      if jnp.result_type(g) != p.dtype:
        raise ValueError(
            f"gradient {path} is {_tree.leaf_description(g)} but its param is "
            f"{_tree.leaf_description(p)}; gradients must be in the param "
            f"dtype (differentiate the scaled loss with respect to the params)")
    elif _tree.is_floating_value(g):
      raise ValueError(
          f"gradient {path} is floating ({_tree.leaf_description(g)}) but its "
          f"param is {_tree.leaf_description(p)}, which is not trainable")


@dataclasses.dataclass(frozen=True)
class ParamsSpec:
  """The structure, shapes and dtypes an optimizer state was built for.

  Static (no leaves): it travels in the state's tree structure, so a state
  used with other params is refused by name instead of failing inside XLA.
  """

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]

  @classmethod
  def of(cls, params: Any) -> "ParamsSpec":
    leaves = _tree.leaves_with_paths(params)
    return cls(jax.tree_util.tree_structure(params),
               tuple(path for path, _ in leaves),
               tuple(tuple(np.shape(x)) for _, x in leaves),
               tuple(_dtype_name(x) for _, x in leaves))

  def describe_mismatch(self, params: Any) -> Optional[str]:
    """How ``params`` differs from this spec, naming the first leaf; or None."""
    other = ParamsSpec.of(params)
    if other.treedef != self.treedef:
      only_params = [p for p in other.paths if p not in set(self.paths)]
      only_state = [p for p in self.paths if p not in set(other.paths)]
      if only_params or only_state:
        return (f"leaf paths differ: only in params: "
                f"{only_params[:5] or 'none'}; only in the optimizer state: "
                f"{only_state[:5] or 'none'}")
      return f"tree structures differ: {other.treedef} vs {self.treedef}"
    for path, shape, dtype, want_shape, want_dtype in zip(
        other.paths, other.shapes, other.dtypes, self.shapes, self.dtypes):
      if (shape, dtype) != (want_shape, want_dtype):
        return (f"param {path} is {dtype}{list(shape)} but the optimizer "
                f"state was built for {want_dtype}{list(want_shape)}")
    return None


jax.tree_util.register_static(ParamsSpec)


def _dtype_name(x: Any) -> str:
  return np.dtype(x.dtype).name if hasattr(x, "dtype") else type(x).__name__


def check_state_matches(spec: ParamsSpec, params: Any) -> None:
  """Raises ValueError if ``params`` is not what the state was built for."""
  mismatch = spec.describe_mismatch(params)
  if mismatch is not None:
    raise ValueError(
        f"the optimizer state does not match the params (was it built for "
        f"another model?): {mismatch}")


# --------------------------------------------------------------------------
# Trainable (floating) leaves, unscaling and the global finite check.
# --------------------------------------------------------------------------


def floating_only(tree: Any, like: Any) -> Any:
  """``tree`` with None wherever ``like`` has a non-floating leaf.

  The inner optimizer sees only trainable leaves: integer params (and their
  float0 gradients) would break most optax transforms.
  """
  return jax.tree_util.tree_map(
      lambda x, ref: x if _tree.is_floating_array(ref) else None, tree, like)


def merge_floating(floating: Any, rest: Any) -> Any:
  """Fills the None holes of :func:`floating_only` back in from ``rest``."""
  return jax.tree_util.tree_map(
      lambda f, r: r if f is None else f, floating, rest,
      is_leaf=lambda x: x is None)


def unscale_and_check(grads: Any, params: Any, loss_scale: LossScale,
                      axis_name=None) -> tuple[Any, jax.Array]:
  """Unscaled fp32 trainable gradients, and whether all of them are finite.

  The one global finite check of every jmp_lab optimizer: under ``jit`` XLA
  fuses the unscale into the reduction, so it reads each gradient once.
  """
  # jmp_lab.jmp's NoOpLossScale unscales to the tree itself (as jmp's does):
  # the inner optimizer must still see fp32.
  unscaled = jax.tree_util.tree_map(
      lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))
      if _tree.is_floating_array(g) else g, loss_scale.unscale(grads))
  grads32 = floating_only(unscaled, params)
  return grads32, all_finite(grads32, axis_name=axis_name)


MASTER_MODES = ("float32", "remainder", "none")
ROUNDING_MODES = ("nearest", "stochastic")


def check_master_mode(master: str, rounding: str, policy: Policy) -> None:
  """Refuses a master/rounding combination the policy cannot have."""
  if master not in MASTER_MODES:
    raise ValueError(f"unknown master {master!r}; accepted: "
                     f"{', '.join(map(repr, MASTER_MODES))}")
  if rounding not in ROUNDING_MODES:
    raise ValueError(f"unknown rounding {rounding!r}; accepted: "
                     f"{', '.join(map(repr, ROUNDING_MODES))}")
  if master != "none" and rounding != "nearest":
    raise ValueError(
        f"rounding={rounding!r} needs master='none': with master={master!r} "
        f"the params are cast(master), rounded to nearest")
  if master == "float32":
    return
  dtype = np.dtype(policy.param_dtype)
  if dtype.itemsize >= 4:
    raise ValueError(
        f"master={master!r} needs half params, but the policy's param dtype "
        f"is {dtype.name}: fp32 params are their own master")
  if master == "remainder" and dtype != np.dtype(jnp.bfloat16):
    raise ValueError(
        f"master='remainder' needs bfloat16 params (bf16 is the upper half of "
        f"an fp32 number; {dtype.name} is not): use master='float32'")
  if rounding == "stochastic" and dtype != np.dtype(jnp.bfloat16):
    raise ValueError(
        f"rounding='stochastic' needs bfloat16 params, got {dtype.name}")
