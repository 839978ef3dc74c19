"""How Flax's layers are called: what the precision front ends read from a call.

Flax's ``Einsum`` (linen and NNX) takes its subscripts either at the call or
from the module; the layers that swap in the reduce-dtype or fp8 einsum need
both the inputs and the subscripts the layer would have used.
"""

from __future__ import annotations

from typing import Any, Sequence


def flax_einsum_call(module: Any, args: Sequence[Any],
                     kwargs: dict[str, Any]) -> tuple[Any, str]:
  """``(inputs, subscripts)`` of a call ``module(inputs, einsum_str=None)``
  of flax's ``Einsum`` (linen or NNX), spaces removed; ``einsum_str``
  defaults to the module's.
  """
  inputs = args[0] if args else kwargs["inputs"]
  subscripts = (args[1] if len(args) > 1 else kwargs.get("einsum_str")) \
      or module.einsum_str
  return inputs, subscripts.replace(" ", "")
