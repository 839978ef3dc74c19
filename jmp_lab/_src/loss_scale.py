"""Loss scaling: keeps small fp16 gradients from flushing to zero.

The implementation behind :mod:`jmp_lab.loss_scale`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import math
from typing import Any, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels import pytrees
# The skip select is the kernels' pytree helper (the optimizers' gate uses
# it too): one implementation, public here.
from jmp_lab.kernels.pytrees import scalar_predicate, select_tree  # noqa: F401

T = TypeVar("T")


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


# --------------------------------------------------------------------------
# Scaling arithmetic, shared by every loss scale.
# --------------------------------------------------------------------------


def _working_dtype(dtype) -> np.dtype:
  # At least float32: scaling a half-precision value in half precision would
  # overflow at the very scales loss scaling uses.
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


def _map_floating_in_working_dtype(tree: T, fn) -> T:
  """Applies ``fn(x, work_dtype)`` to floating values; the rest pass through."""

  def apply(x):
    if not pytrees.is_floating_value(x):
      return x
    x = jnp.asarray(x)
    return fn(x, _working_dtype(x.dtype))

  return jax.tree_util.tree_map(apply, tree)


def _scale_tree(tree: T, loss_scale: jax.Array) -> T:
  # Back to each leaf's own dtype: the caller differentiates through it.
  return _map_floating_in_working_dtype(
      tree, lambda x, work: (x.astype(work) * loss_scale.astype(work)
                             ).astype(x.dtype))


def _unscale_tree(tree: T, loss_scale: jax.Array) -> T:
  # Stays in the working dtype (fp32 for half leaves): the point of unscaling.
  return _map_floating_in_working_dtype(
      tree, lambda x, work: x.astype(work) / loss_scale.astype(work))


def _concrete_float(x: Any) -> Optional[float]:
  """``float(x)`` when ``x`` is concrete, None when it is being traced."""
  try:
    return float(x)
  except (jax.errors.ConcretizationTypeError,
          jax.errors.TracerArrayConversionError):
    return None


def _as_scale_leaf(value: Any, what: str) -> jax.Array:
  """Validates a loss-scale value and stores it as an f32 scalar array."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what} must be a positive number, got {value!r}")
  if jnp.ndim(value) != 0:
    raise ValueError(
        f"{what} must be a scalar, got shape {jnp.shape(value)}")
  concrete = _concrete_float(value)
  if concrete is not None and not (math.isfinite(concrete) and concrete > 0):
    raise ValueError(f"{what} must be finite and > 0, got {concrete!r}")
  # Always f32, whatever came in (an fp16 scale broke jmp): one dtype means
  # one compiled program and no dtype clashes inside select.
  return jnp.asarray(value, dtype=jnp.float32)


# --------------------------------------------------------------------------
# The loss scales.
# --------------------------------------------------------------------------


def _register_pytree(leaf_fields: tuple[str, ...],
                     static_fields: tuple[str, ...]):
  """Registers a frozen dataclass as a pytree with named leaves.

  Leaves get ``GetAttrKey`` paths (so ``optax.tree_utils`` and orbax can name
  them); static fields travel as auxiliary data, all of them, so nothing is
  lost on a flatten/unflatten round trip.
  """

  def register(cls):
    def flatten_with_keys(obj):
      children = tuple((jax.tree_util.GetAttrKey(name), getattr(obj, name))
                       for name in leaf_fields)
      return children, tuple(getattr(obj, name) for name in static_fields)

    def flatten(obj):
      return (tuple(getattr(obj, name) for name in leaf_fields),
              tuple(getattr(obj, name) for name in static_fields))

    def unflatten(aux, children):
      # Bypasses __init__: leaves may be tracers, None or sentinel objects
      # while JAX transforms the tree, and must not be validated or cast.
      obj = object.__new__(cls)
      for name, value in zip(leaf_fields, children):
        object.__setattr__(obj, name, value)
      for name, value in zip(static_fields, aux):
        object.__setattr__(obj, name, value)
      return obj

    jax.tree_util.register_pytree_with_keys(
        cls, flatten_with_keys, unflatten, flatten)
    cls._pytree_fields = (leaf_fields, static_fields)
    return cls

  return register


class LossScale(abc.ABC):
  """The interface shared by every loss scale.

  Every subclass has a ``loss_scale`` attribute: the current scale, an f32
  scalar array. (It is a field or property of each subclass rather than an
  abstract property here, because a property on the base would shadow the
  dataclass fields of the subclasses.)
  """

  loss_scale: jax.Array

  def __init_subclass__(cls, **kwargs):
    # A subclass of a registered loss scale (jmp_lab.jmp's, or a user's) is a
    # pytree with the same fields; without this it would be a single leaf.
    super().__init_subclass__(**kwargs)
    fields = getattr(cls, "_pytree_fields", None)
    if fields is not None:
      _register_pytree(*fields)(cls)

  def __eq__(self, other: Any) -> bool:
    """Loss scales compare by value, as jmp's do (outside ``jit`` only)."""
    if type(self) is not type(other):
      return NotImplemented
    mine, my_config = jax.tree_util.tree_flatten(self)
    theirs, their_config = jax.tree_util.tree_flatten(other)
    if my_config != their_config:
      return False
    try:
      return all(np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(mine, theirs))
    except jax.errors.TracerArrayConversionError:
      raise TypeError(
          "traced loss scales cannot be compared by value; compare their "
          ".loss_scale arrays with jnp instead") from None

  __hash__ = None  # equal by value, and arrays are not hashable

  def __float__(self) -> float:
    """The current scale as a Python float: ``float(state.loss_scale)``.

    It reads the scale back to the host, so it works on a concrete loss
    scale only; inside ``jit`` use ``.loss_scale`` (an f32 array).

    >>> import jmp_lab
    >>> float(jmp_lab.DynamicLossScale(2.0**15)), float(jmp_lab.NoOpLossScale())
    (32768.0, 1.0)
    """
    try:
      return float(self.loss_scale)
    except (jax.errors.ConcretizationTypeError,
            jax.errors.TracerArrayConversionError):
      raise TypeError(
          f"float() of a traced {type(self).__name__} would read it back to "
          f"the host inside a jitted function; use its .loss_scale (an f32 "
          f"array) there") from None

  def scale(self, tree: T) -> T:
    """Multiplies floating leaves by the scale, keeping their dtypes."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides floating leaves by the scale; the results are float32."""
    return _unscale_tree(tree, self.loss_scale)

  @abc.abstractmethod
  def adjust(self, grads_finite: jax.Array) -> "LossScale":
    """Returns the loss scale for the next step."""


@_register_pytree(leaf_fields=(), static_fields=())
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(LossScale):
  """No scaling: ``scale`` is the identity and ``unscale`` only casts to f32."""

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def scale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
    scalar_predicate(grads_finite, "grads_finite")
    return self


@_register_pytree(leaf_fields=("loss_scale",), static_fields=())
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(LossScale):
  """A fixed scale.

  The scale is a traced leaf, not a compile-time constant, so a jitted step
  that receives a different ``StaticLossScale`` does not recompile.

  Args:
    loss_scale: a finite, positive scalar.
  """

  loss_scale: jax.Array

  def __post_init__(self):
    object.__setattr__(self, "loss_scale",
                       _as_scale_leaf(self.loss_scale, "loss_scale"))

  def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
    scalar_predicate(grads_finite, "grads_finite")
    return self


@_register_pytree(
    leaf_fields=("loss_scale", "counter"),
    static_fields=("growth_interval", "growth_factor", "backoff_factor",
                   "min_loss_scale", "max_loss_scale"),
)
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
  """A scale that backs off on overflow and grows after a run of finite steps.

  The update rule is PyTorch's ``GradScaler``:

  * on a non-finite step, multiply by ``backoff_factor`` and reset the counter;
  * on the ``growth_interval``-th consecutive finite step, multiply by
    ``growth_factor`` and reset the counter;
  * otherwise count the finite step.

  The result is always clamped to ``[min_loss_scale, max_loss_scale]`` and
  never becomes non-finite.

  Args:
    loss_scale: the initial scale, within ``[min_loss_scale, max_loss_scale]``.
    growth_interval: consecutive finite steps before growing (>= 1).
    growth_factor: multiplier on growth (> 1).
    backoff_factor: multiplier on overflow, in (0, 1).
    min_loss_scale: lower bound (> 0).
    max_loss_scale: upper bound (>= min_loss_scale).
    counter: consecutive finite steps so far (int32); normally left at 0.

  ``period`` and ``factor`` read ``growth_interval`` and ``growth_factor``
  by jmp's names; they are not arguments here. Build one from jmp's
  arguments with ``from jmp_lab import jmp``, ``jmp.DynamicLossScale(
  loss_scale, period=..., factor=...)``, the drop-in for jmp.
  """

  loss_scale: jax.Array = 2.0**15
  growth_interval: int = 2000
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  min_loss_scale: float = 1.0
  max_loss_scale: float = 2.0**24
  counter: Optional[jax.Array] = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self):
    config = _validated_dynamic_config(
        growth_interval=self.growth_interval,
        growth_factor=self.growth_factor,
        backoff_factor=self.backoff_factor,
        min_loss_scale=self.min_loss_scale,
        max_loss_scale=self.max_loss_scale)
    for name, value in config.items():
      object.__setattr__(self, name, value)
    scale = _as_scale_leaf(self.loss_scale, "loss_scale")
    concrete = _concrete_float(scale)
    if concrete is not None and not (
        self.min_loss_scale <= concrete <= self.max_loss_scale):
      raise ValueError(
          f"loss_scale {concrete!r} is outside [min_loss_scale, "
          f"max_loss_scale] = [{self.min_loss_scale!r}, "
          f"{self.max_loss_scale!r}]")
    object.__setattr__(self, "loss_scale", scale)
    counter = jnp.zeros((), jnp.int32) if self.counter is None else self.counter
    if jnp.ndim(counter) != 0 or not jnp.issubdtype(
        jnp.result_type(counter), jnp.integer):
      raise TypeError(
          f"counter must be an integer scalar, got "
          f"{pytrees.leaf_description(counter)}")
    object.__setattr__(self, "counter", jnp.asarray(counter, jnp.int32))

  @property
  def period(self) -> int:
    """jmp's name for ``growth_interval``."""
    return self.growth_interval

  @property
  def factor(self) -> float:
    """jmp's name for ``growth_factor``."""
    return self.growth_factor

  def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
    grads_finite = scalar_predicate(grads_finite, "grads_finite")
    next_counter = self.counter + 1
    grow = grads_finite & (next_counter >= self.growth_interval)
    grown = jnp.minimum(self.loss_scale * self.growth_factor,
                        self.max_loss_scale)
    backed_off = jnp.maximum(self.loss_scale * self.backoff_factor,
                             self.min_loss_scale)
    new_scale = jnp.where(grads_finite,
                          jnp.where(grow, grown, self.loss_scale),
                          backed_off)
    # Belt and braces for max_loss_scale=inf: a scale never becomes inf/nan.
    new_scale = jnp.where(jnp.isfinite(new_scale), new_scale, self.loss_scale)
    new_counter = jnp.where(grads_finite & ~grow, next_counter, 0)
    return _replace_leaves(
        self, loss_scale=new_scale.astype(jnp.float32),
        counter=new_counter.astype(jnp.int32))


def fresh_copy(loss_scale: LossScale) -> LossScale:
  """A copy with its own buffers.

  Optimizers put this in each new state: the state is routinely donated,
  and donating the caller's own loss-scale arrays would delete them under
  every later ``init`` that shares them.
  """
  return jax.tree_util.tree_map(jnp.copy, loss_scale)


def _replace_leaves(obj, **leaves):
  """``dataclasses.replace`` without re-running validation.

  Validation reads values back to the host (``float(x)``); on the step path
  that would be a device sync, and the new values are valid by construction.
  """
  new = copy.copy(obj)
  for name, value in leaves.items():
    object.__setattr__(new, name, value)
  return new


def _validated_dynamic_config(*, growth_interval, growth_factor,
                              backoff_factor, min_loss_scale, max_loss_scale
                              ) -> dict[str, Any]:
  """Checks DynamicLossScale's configuration and returns it as Python numbers.

  These values are static (part of the compiled program), so they must be
  concrete; Python numbers also keep the pytree's aux data hashable.
  """

  def as_number(name, value, kind):
    if isinstance(value, (bool, np.bool_)) or _concrete_float(value) is None:
      raise TypeError(f"{name} must be a concrete number, got {value!r}")
    if kind is int:
      if float(value) != int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
      return int(value)
    return float(value)

  config = {
      "growth_interval": as_number("growth_interval", growth_interval, int),
      "growth_factor": as_number("growth_factor", growth_factor, float),
      "backoff_factor": as_number("backoff_factor", backoff_factor, float),
      "min_loss_scale": as_number("min_loss_scale", min_loss_scale, float),
      "max_loss_scale": as_number("max_loss_scale", max_loss_scale, float),
  }
  if config["growth_interval"] < 1:
    raise ValueError(
        f"growth_interval must be >= 1, got {config['growth_interval']}")
  if not config["growth_factor"] > 1:
    raise ValueError(
        f"growth_factor must be > 1, got {config['growth_factor']}")
  if not 0 < config["backoff_factor"] < 1:
    raise ValueError(
        f"backoff_factor must be in (0, 1), got {config['backoff_factor']}")
  if not (math.isfinite(config["min_loss_scale"])
          and config["min_loss_scale"] > 0):
    raise ValueError(
        f"min_loss_scale must be finite and > 0, got "
        f"{config['min_loss_scale']}")
  if not config["max_loss_scale"] > 0 or math.isnan(config["max_loss_scale"]):
    raise ValueError(
        f"max_loss_scale must be > 0, got {config['max_loss_scale']}")
  if config["min_loss_scale"] > config["max_loss_scale"]:
    raise ValueError(
        f"min_loss_scale {config['min_loss_scale']} is greater than "
        f"max_loss_scale {config['max_loss_scale']}")
  return config
