"""jmp's API on jmp_lab's classes: ``from jmp_lab import jmp`` migrates.

The implementation behind :mod:`jmp_lab.jmp`, whose docstring describes it
with examples.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar
import warnings

import jax.numpy as jnp
import numpy as np

from jmp_lab._src import loss_scale as _loss_scale
from jmp_lab._src.optim import gate as _gate
from jmp_lab._src import policy as _policy

T = TypeVar("T")

Policy = _policy.Policy
LossScale = _loss_scale.LossScale
StaticLossScale = _loss_scale.StaticLossScale
all_finite = _gate.all_finite
select_tree = _loss_scale.select_tree
half_dtype = _policy.half_dtype

# As in jmp, keyed by the jnp scalar types; the first name is what
# ``str(policy)`` prints.
dtype_to_names = {
    jnp.bfloat16: ("bfloat16", "bf16"),
    jnp.float16: ("float16", "f16"),
    jnp.float32: ("float32", "f32", "full", "single"),
    jnp.float64: ("float64", "f64"),
}


def get_policy(policy_name: str) -> Policy:
  """``jmp.get_policy``: parses ``"p=f32,c=bf16,o=f32"``, ``"half"``...

  Errors read as jmp's do ("Unknown dtype ..."), with jmp_lab's detail.
  """
  try:
    return _policy.get_policy(policy_name)
  except ValueError as e:
    message = str(e)
    raise ValueError(message[:1].upper() + message[1:]) from None


def cast_to_full(tree: T) -> T:
  """Casts floating leaves to float32 (others pass through)."""
  return _policy.cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Casts floating leaves to :func:`half_dtype` (others pass through)."""
  return _policy.cast_floating(tree, half_dtype())


class NoOpLossScale(_loss_scale.NoOpLossScale):
  """jmp's no-op scale: ``scale`` and ``unscale`` both return the tree itself.

  (jmp_lab's own :class:`jmp_lab.NoOpLossScale` unscales to float32.)
  """

  def unscale(self, tree: T) -> T:
    return tree


def _warn_if_integer(value: Any, name: str) -> None:
  # jmp warns here; code written against it may assert the warning.
  dtype = getattr(value, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}; it is "
                  f"converted to float32", stacklevel=3)


class DynamicLossScale(_loss_scale.DynamicLossScale):
  """jmp's signature on :class:`jmp_lab.DynamicLossScale`.

  ``factor`` is both the growth factor and the inverse of the backoff factor,
  as in jmp; ``period`` is the growth interval. ``max_loss_scale`` (which jmp
  lacks) keeps jmp_lab's default bound.
  """

  def __init__(self, loss_scale, counter: Optional[Any] = None,
               period: int = 2000, factor: float = 2,
               min_loss_scale: Any = 1.0,
               max_loss_scale: float = _loss_scale.DynamicLossScale.max_loss_scale):
    _warn_if_integer(loss_scale, "loss_scale")
    _warn_if_integer(min_loss_scale, "min_loss_scale")
    factor = float(np.asarray(factor))
    super().__init__(loss_scale=loss_scale, counter=counter,
                     growth_interval=period, growth_factor=factor,
                     # A factor <= 0 is passed on for the validation to
                     # name it, rather than failing here on 1 / 0.
                     backoff_factor=1 / factor if factor > 0 else factor,
                     min_loss_scale=min_loss_scale,
                     max_loss_scale=max_loss_scale)
