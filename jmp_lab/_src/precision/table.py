"""The interpreter's dispatch: which handler evaluates an equation.

:mod:`.handlers` (first-order primitives) and :mod:`.control` (those with
sub-jaxprs) register their choosers here when the engine's package is
imported, so the interpreter depends on this table, not on them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# (eqn) -> the higher-order handler, or None for a first-order primitive.
higher_order: Optional[Callable[[Any], Optional[Callable]]] = None
# (name, region, rules, pulled) -> the first-order handler.
first_order: Optional[Callable[..., Callable]] = None


def handler(op: Any) -> Callable:
  """The handler of the equation ``op`` evaluates."""
  found = higher_order(op.eqn)
  if found is not None:
    return found
  return first_order(op.name, op.region, op.context.rules, op.pulled)
