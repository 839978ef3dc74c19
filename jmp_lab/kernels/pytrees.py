"""Pytree helpers every jmp_lab module asks the same way.

They answer two questions that several modules ask: "is this leaf a floating
value?" and "where do these two trees differ?". Keeping them here means every
module gives the same answer and the same error message.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


__all__ = [
    "check_same_structure",
    "first_structure_mismatch",
    "is_floating_array",
    "is_floating_value",
    "leaf_description",
    "leaves_with_paths",
]
