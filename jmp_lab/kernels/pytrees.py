"""Pytree helpers every jmp_lab module asks the same way.

They answer two questions that several modules ask: "is this leaf a floating
value?" and "where do these two trees differ?". Keeping them here means every
module gives the same answer and the same error message.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def is_floating_array(x: Any) -> bool:
  """True for JAX/NumPy arrays and scalars with a floating dtype.

  Python scalars are not arrays: they are weakly typed in JAX. PRNG key arrays
  and float0 (the tangent type of integer leaves) are not floating.
  """
  return (
      isinstance(x, (jax.Array, np.ndarray, np.generic))
      and jnp.issubdtype(x.dtype, jnp.floating)
  )


def is_floating_value(x: Any) -> bool:
  """Like :func:`is_floating_array`, but Python floats count too."""
  return isinstance(x, float) or is_floating_array(x)


def leaf_description(x: Any) -> str:
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"
  return type(x).__name__


def first_structure_mismatch(
    a: Any, b: Any, *, is_leaf: Optional[Callable[[Any], bool]] = None
) -> Optional[str]:
  """Describes where ``a`` and ``b`` first differ in structure, or None."""
  paths_a, treedef_a = jax.tree_util.tree_flatten_with_path(a, is_leaf=is_leaf)
  paths_b, treedef_b = jax.tree_util.tree_flatten_with_path(b, is_leaf=is_leaf)
  if treedef_a == treedef_b:
    return None
  keys_a = [jax.tree_util.keystr(p) for p, _ in paths_a]
  keys_b = [jax.tree_util.keystr(p) for p, _ in paths_b]
  only_a = [k for k in keys_a if k not in set(keys_b)]
  only_b = [k for k in keys_b if k not in set(keys_a)]
  if only_a or only_b:
    return (
        f"leaf paths differ: only in the first: {only_a[:5] or 'none'}; "
        f"only in the second: {only_b[:5] or 'none'}"
    )
  return f"tree structures differ: {treedef_a} vs {treedef_b}"


def check_same_structure(
    a: Any, b: Any, *, names: Sequence[str] = ("first", "second")
) -> None:
  """Raises ValueError naming the first place where ``a`` and ``b`` differ."""
  mismatch = first_structure_mismatch(a, b)
  if mismatch is not None:
    raise ValueError(f"{names[0]} and {names[1]} trees do not match: {mismatch}")


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(p) or "<root>", x) for p, x in paths]


def scalar_predicate(pred: Any, what: str) -> jax.Array:
  """``pred`` as a scalar bool array (a Python bool too); a TypeError that
  names ``what`` for anything else."""
  if isinstance(pred, (bool, np.bool_)):
    return jnp.asarray(pred)
  dtype = getattr(pred, "dtype", None)
  shape = getattr(pred, "shape", None)
  if dtype is None or np.dtype(dtype) != np.bool_ or shape != ():
    raise TypeError(
        f"{what} must be a scalar bool (such as the result of all_finite), "
        f"got {leaf_description(pred)}"
    )
  return pred


def select_tree(pred: Any, on_true: T, on_false: T) -> T:
  """Picks ``on_true`` or ``on_false`` leaf by leaf, on device, without a sync.

  Args:
    pred: a scalar bool.
    on_true: the tree returned where ``pred`` is True.
    on_false: a tree with the same structure, shapes and dtypes.

  Returns:
    A tree like ``on_true``.

  Raises:
    TypeError: if ``pred`` is not a scalar bool.
    ValueError: if the trees differ in structure, or a leaf in shape or dtype;
      the message names the first such leaf.
  """
  pred = scalar_predicate(pred, "select_tree's pred")
  check_same_structure(on_true, on_false, names=("on_true", "on_false"))
  for (path, x), (_, y) in zip(leaves_with_paths(on_true),
                               leaves_with_paths(on_false)):
    if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
      raise ValueError(
          f"select_tree: leaf {path} differs: on_true is "
          f"{leaf_description(x)}, on_false is "
          f"{leaf_description(y)}; shapes and dtypes must match"
      )
  return jax.tree_util.tree_map(
      lambda x, y: jax.lax.select(pred, x, y) if jnp.ndim(x) == 0
      else jnp.where(pred, x, y),
      on_true, on_false)


__all__ = [
    "check_same_structure",
    "scalar_predicate",
    "select_tree",
    "first_structure_mismatch",
    "is_floating_array",
    "is_floating_value",
    "leaf_description",
    "leaves_with_paths",
]
