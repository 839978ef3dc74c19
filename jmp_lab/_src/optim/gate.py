"""The gate every jmp_lab update passes: unscale, one global finite check,
and the skip select.

``mixed_precision`` and ``fused_adamw`` (and the public
:func:`jmp_lab.all_finite`) decide whether a step is applied here. The check
takes extra finite flags (``also_finite``): fp8's observed amaxes, or
anything else a train step knows, make the step skip like an overflowing
gradient does, without touching the gradients.
"""

from __future__ import annotations

from typing import Any


import jax
import jax.numpy as jnp

from jmp_lab.kernels import pytrees
from jmp_lab.kernels import stats
# The skip select is a pytree helper of the kernels' layer (loss scales use
# it too): one implementation.
from jmp_lab.kernels.pytrees import scalar_predicate, select_tree  # noqa: F401
from jmp_lab.kernels.stats import Axes


def flags(also_finite: Any) -> list:
  """``also_finite`` (None, a scalar bool, or a sequence of them) as a
  list of scalar bool arrays, checked."""
  if also_finite is None:
    return []
  found = (list(also_finite) if isinstance(also_finite, (list, tuple))
           else [also_finite])
  for flag in found:
    if not (getattr(flag, "shape", None) == () or isinstance(flag, bool)) or (
        jnp.result_type(flag) != jnp.bool_):
      raise TypeError(
          f"also_finite must be a scalar bool (or a sequence of them), such "
          f"as jmp_lab.all_finite(...), got {pytrees.leaf_description(flag)}")
  return found


def all_finite(tree: Any, *, axis_name: Axes = None,
               also_finite: Any = None) -> jax.Array:
  """Whether every floating value in ``tree`` is finite, as one scalar bool.

  Integer, boolean, PRNG-key and float0 leaves are finite by definition. An
  empty tree gives True. Under ``jit`` with sharded inputs the reduction is
  already global; inside ``shard_map`` pass the mapped ``axis_name`` so that
  every device agrees.

  Args:
    tree: any pytree.
    axis_name: optional mapped axis name(s) to combine the flag across.
    also_finite: a scalar bool (or a sequence of them) that must be True
      too: a train step's other evidence of an overflow (fp8's amaxes).

  Returns:
    A scalar ``bool`` array.
  """
  values = [x for x in jax.tree_util.tree_leaves(tree)
            if pytrees.is_floating_value(x)]
  return stats.agree(stats.all_finite(values, flags(also_finite)), axis_name)


def unscale(grads: Any, params: Any, loss_scale: Any) -> Any:
  """The trainable gradients unscaled to fp32 (None where the param is not
  floating: the inner optimizer sees only trainable leaves)."""
  # jmp_lab.jmp's NoOpLossScale unscales to the tree itself (as jmp's does):
  # the inner optimizer must still see fp32.
  unscaled = jax.tree_util.tree_map(
      lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))
      if pytrees.is_floating_array(g) else g, loss_scale.unscale(grads))
  return floating_only(unscaled, params)


def unscale_and_check(grads: Any, params: Any, loss_scale: Any,
                      axis_name: Axes = None, also_finite: Any = None
                      ) -> tuple[Any, jax.Array]:
  """Unscaled fp32 trainable gradients, and whether the step may apply:
  under ``jit`` XLA fuses the unscale into the check, so it reads each
  gradient once."""
  grads32 = unscale(grads, params, loss_scale)
  return grads32, all_finite(grads32, axis_name=axis_name,
                             also_finite=also_finite)


def floating_only(tree: Any, like: Any) -> Any:
  """``tree`` with None wherever ``like`` has a non-floating leaf.

  The inner optimizer sees only trainable leaves: integer params (and their
  float0 gradients) would break most optax transforms.
  """
  return jax.tree_util.tree_map(
      lambda x, ref: x if pytrees.is_floating_array(ref) else None, tree, like)


def merge_floating(floating: Any, rest: Any) -> Any:
  """Fills the None holes of :func:`floating_only` back in from ``rest``."""
  return jax.tree_util.tree_map(
      lambda f, r: r if f is None else f, floating, rest,
      is_leaf=lambda x: x is None)
