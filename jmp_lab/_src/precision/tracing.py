"""Small adapters over jax's jaxpr internals, in one place.

jax 0.12 merges closed and open jaxprs; these helpers treat both alike, so
the interpreter reads either.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from jax._src import api_util as _api_util  # noqa: E402
from jax._src import linear_util as _lu  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402


def trace(fun: Callable, in_avals: Sequence[Any], debug_info: Optional[Any]):
  """``fun`` traced to an open jaxpr over ``in_avals`` (exact types: weak
  types and varying axes kept), and its constants."""
  if debug_info is None:
    debug_info = _api_util.debug_info("jmp_lab.autocast", fun,
                                      tuple(in_avals), {})
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
      _lu.wrap_init(fun, debug_info=debug_info), list(in_avals))
  return jaxpr, consts


def wrap(fun: Callable, debug_info: Any):
  """``fun`` as the ``WrappedFun`` jax's custom-derivative params hold."""
  return _lu.wrap_init(fun, debug_info=debug_info)


def is_jaxpr(value: Any) -> bool:
  return hasattr(value, "eqns") or (
      hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"))


def is_closed(value: Any) -> bool:
  return hasattr(value, "jaxpr") and hasattr(value, "consts")


def open_jaxpr(value: Any) -> tuple[Any, list]:
  """``(jaxpr, consts)`` of a closed or open jaxpr."""
  if is_closed(value):
    return value.jaxpr, list(value.consts)
  return value, list(getattr(value, "consts", ()))


def has_subjaxprs(eqn: Any) -> bool:
  return any(is_jaxpr(v) or (isinstance(v, (tuple, list))
                             and any(is_jaxpr(x) for x in v))
             for v in eqn.params.values())


def sub_jaxprs(params: dict) -> list:
  """The jaxprs among an equation's params."""
  found = []
  for value in params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if is_jaxpr(sub):
        found.append(sub)
  return found


def memoized(thunk: Callable) -> Callable:
  cache: dict = {}

  def call(*key):
    if key not in cache:
      cache[key] = thunk(*key)
    return cache[key]

  return call
