"""Which of a loop's stacked inputs the rules read only as half GEMM operands.

A model scanned over its layers (``nn.scan``, ``nnx.scan``) hands the loop
its params stacked, ``[layers, ...]``. Under a policy with float32 params,
each layer reads its kernels in the compute dtype inside the loop body. XLA
then keeps the float32 stack as the loop's input in the layout the body's
all-gather wants (a transposed float32 copy of the stack) and builds the
stack of float32 gradients inside the backward loop. Cast to the compute
dtype before the loop, the stack enters it in half: the copies and the
stacked gradients are half as large, and the cast's own gradient turns the
half gradients into float32 once, after the loop. Compiled for 8 H100s, the
7B-class Llama's step under ``mixed_bfloat16`` needs 1.9 GiB less a device
(``benchmarks/RESULTS.md``).

The cast is exact only where nothing but a GEMM reads the value: a GEMM casts
its operands to the matmul dtype anyway, and layout changes (reshape,
transpose, slices, broadcasts) move values without arithmetic. So
:func:`half_gemm_operand` follows a value through layout changes and calls
(``pjit``, ``checkpoint``, custom derivatives' primal functions) and answers
with the one half dtype its GEMMs (or casts to half: a front end's read of
a param) read it in, or None where anything else reads it: a norm's scale read in float32, an fp8 quantization, a nested
loop. The program computes the same values either way.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from jax.extend import core as jex_core

from jmp_lab import _compat as compat
from jmp_lab._src.precision import scopes, tracing
from jmp_lab._src.precision.ops import MATMUL_OPS
from jmp_lab._src.precision.values import is_half

#: Ops that move values without arithmetic: a value read through them is
#: still read as it is.
LAYOUT_OPS = frozenset({
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "rev", "copy", "copy_p", "sharding_constraint",
})

#: Calls whose sub-jaxpr takes the call's inputs in order.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}

_NOT_ONLY_GEMMS = "not only GEMMs"


def half_gemm_operand(jaxpr: Any, consts: list, index: int, rules: Any,
                      base: tuple[str, ...]) -> Optional[np.dtype]:
  """The half dtype in which GEMMs read input ``index`` of ``jaxpr`` (an
  open jaxpr evaluated under ``rules`` at named-scope path ``base``), if
  GEMMs in one half dtype are all that read it; else None."""
  _, invars = compat.jaxpr_inputs(jaxpr, consts)
  found: set = set()
  if _uses(jaxpr, invars[index], rules, base, found) is _NOT_ONLY_GEMMS:
    return None
  return found.pop() if len(found) == 1 else None


def _uses(jaxpr, var, rules, base, found: set):
  """Adds to ``found`` the matmul dtype of each GEMM that reads ``var``;
  returns ``_NOT_ONLY_GEMMS`` as soon as anything else reads it."""
  if any(v is var for v in jaxpr.outvars):
    return _NOT_ONLY_GEMMS  # it leaves the body: read by whatever is outside
  for eqn in jaxpr.eqns:
    positions = [i for i, v in enumerate(eqn.invars)
                 if not isinstance(v, jex_core.Literal) and v is var]
    if not positions:
      continue
    path = base + scopes.scope_names(eqn.source_info.name_stack)
    name = eqn.primitive.name
    if name in MATMUL_OPS:
      matmul = rules.region(path).matmul
      if matmul is None or not is_half(matmul) or max(positions) > 1:
        return _NOT_ONLY_GEMMS
      found.add(np.dtype(matmul))
    elif name == "convert_element_type" and is_half(
        eqn.params["new_dtype"]):
      found.add(np.dtype(eqn.params["new_dtype"]))  # read in half: the cast
    elif name in LAYOUT_OPS and positions == [0]:
      if _uses(jaxpr, eqn.outvars[0], rules, base, found) is _NOT_ONLY_GEMMS:
        return _NOT_ONLY_GEMMS
    elif name in _CALLS and tracing.is_jaxpr(eqn.params.get(_CALLS[name])):
      if _uses_in_call(eqn, positions, rules, path, found) is _NOT_ONLY_GEMMS:
        return _NOT_ONLY_GEMMS
    else:
      return _NOT_ONLY_GEMMS
  return None


def _uses_in_call(eqn, positions, rules, path, found: set):
  sub, sub_consts = tracing.open_jaxpr(eqn.params[_CALLS[eqn.primitive.name]])
  _, invars = compat.jaxpr_inputs(sub, sub_consts)
  if len(invars) != len(eqn.invars):
    return _NOT_ONLY_GEMMS
  for i in positions:
    if _uses(sub, invars[i], rules, path, found) is _NOT_ONLY_GEMMS:
      return _NOT_ONLY_GEMMS
  return None


__all__ = ["LAYOUT_OPS", "half_gemm_operand"]
