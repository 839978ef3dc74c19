"""NNX objects through the engine: a function of NNX modules (a model's
call, a train step's loss) traced as a pure function of their state, as
NNX's own transforms do."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from flax import nnx

from jmp_lab._src.precision.interpreter import apply_rules


def is_nnx_object(x: Any) -> bool:
  """An NNX module, variable or other NNX object."""
  return isinstance(x, (nnx.Variable, nnx.Pytree))


def holds_nnx_objects(tree: Any) -> bool:
  """Whether ``tree`` holds an NNX module, variable or other NNX object."""
  return any(is_nnx_object(x) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=is_nnx_object))


def call_under_rules(fn: Callable, args: tuple, kwargs: dict, rules) -> Any:
  """``fn(*args, **kwargs)`` under the engine's ``rules``, NNX objects
  among the arguments included.

  The engine traces a pure function, so the module graphs (and any NNX
  object among the arguments, such as an ``nnx.Rngs``) are split, merged
  inside, and their new state (batch statistics, RNG counts) put back
  after: the pattern of NNX's own transforms.
  """
  nodes = [x for x in jax.tree_util.tree_leaves((args, kwargs),
                                                is_leaf=is_nnx_object)
           if is_nnx_object(x)]
  arrays = jax.tree_util.tree_map(
      lambda x: None if is_nnx_object(x) else x, (args, kwargs),
      is_leaf=is_nnx_object)
  graphdef, state = nnx.split(tuple(nodes))

  def pure(state, arrays):
    merged = tuple(nnx.merge(graphdef, state))
    replaced = iter(merged)
    call_args, call_kwargs = jax.tree_util.tree_map(
        lambda x, a: next(replaced) if is_nnx_object(x) else a,
        (args, kwargs), arrays, is_leaf=is_nnx_object)
    return fn(*call_args, **call_kwargs), nnx.state(merged)

  out, new_state = apply_rules(pure, rules)(state, arrays)
  changed = _changed_variables(state, new_state)
  if changed is None:  # the call made new variables: put back everything
    nnx.update(tuple(nodes), new_state)
  elif changed:
    nnx.update(tuple(nodes), nnx.from_flat_state(changed))
  return out


def _changed_variables(before: Any, after: Any) -> Optional[list]:
  """The ``(path, variable)`` pairs of ``after`` whose value is not the one
  in ``before`` (None if the two differ in their paths). Only these are put
  back: a plain forward pass writes nothing, so it may run inside
  ``jax.jit`` on a model made outside it, as a plain NNX module may."""
  old, new = list(nnx.to_flat_state(before)), list(nnx.to_flat_state(after))
  if [path for path, _ in old] != [path for path, _ in new]:
    return None
  raw = lambda v: v.get_raw_value() if isinstance(v, nnx.Variable) else v  # noqa: E731
  return [(path, n) for (path, o), (_, n) in zip(old, new)
          if raw(n) is not raw(o)]
