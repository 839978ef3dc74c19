"""What reads a value in a jaxpr: static analyses the handlers decide by.

:func:`pulled_into_fp32` finds the equations that only feed fp32 ops (they
run in fp32 too: the whole softmax or norm statistic). :func:`half_gemm_operand`
finds the stacked inputs of a loop that one half GEMM reads and nothing else.

Why the second: a model scanned over its layers (``nn.scan``, ``nnx.scan``)
hands the loop its params stacked, ``[layers, ...]``. Under a policy with
float32 params, each layer reads its kernels in the compute dtype inside the
loop body. XLA then keeps the float32 stack as the loop's input in the
layout the body's all-gather wants (a transposed float32 copy of the stack)
and builds the stack of float32 gradients inside the backward loop. Cast to
the compute dtype before the loop, the stack enters it in half: the copies
and the stacked gradients are half as large, and the cast's own gradient
turns the half gradients into float32 once, after the loop. Compiled for 8
H100s, the 7B-class Llama's step under ``mixed_bfloat16`` needs 1.9 GiB less
a device (``benchmarks/RESULTS.md``).

The cast is exact only where one half read is all there is: a GEMM casts
its operands to the matmul dtype anyway, a front end's cast to half of a
param read is the same cast, and layout changes (reshape, transpose, slices,
broadcasts) move values without arithmetic. A second reader (two GEMMs sum
their gradients in float32 after each cast's own transpose; hoisted, the sum
is in half), a cast that only feeds fp32 ops (the interpreter runs it in
fp32), a custom derivative's rules, a nested loop: any of these and the
input is left as it is. So forward values and gradients are the same
either way.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from jax.extend import core as jex_core

from jmp_lab import _compat as compat
from jmp_lab._src.precision import scopes, tracing
from jmp_lab._src.precision.ops import COMPUTE_OPS, MATMUL_OPS
from jmp_lab._src.precision.scopes import is_floating, is_half

#: Ops that move values without arithmetic: a value read through them is
#: still read as it is.
LAYOUT_OPS = frozenset({
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "rev", "copy", "copy_p", "sharding_constraint",
})

#: Calls whose sub-jaxpr takes the call's inputs in order and is all they
#: run (not custom derivatives: their rules read the inputs too).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr"}

_NOT_ONLY_GEMMS = "not only GEMMs"


def half_gemm_operand(jaxpr: Any, consts: list, index: int, rules: Any,
                      base: tuple[str, ...]) -> Optional[np.dtype]:
  """The half dtype in which one GEMM (or a cast to half) reads input
  ``index`` of ``jaxpr`` (an open jaxpr evaluated under ``rules`` at
  named-scope path ``base``), if that one read is all there is; else None."""
  _, invars = compat.jaxpr_inputs(jaxpr, consts)
  found: list = []
  if _uses(jaxpr, invars[index], rules, base, found) is _NOT_ONLY_GEMMS:
    return None
  return found[0] if len(found) == 1 else None


def _uses(jaxpr, var, rules, base, found: list):
  """Adds to ``found`` the half dtype of each read of ``var`` by a GEMM or
  a cast to half; returns ``_NOT_ONLY_GEMMS`` as soon as anything else
  reads it."""
  if any(v is var for v in jaxpr.outvars):
    return _NOT_ONLY_GEMMS  # it leaves the body: read by whatever is outside
  pulled = None
  for index, eqn in enumerate(jaxpr.eqns):
    positions = [i for i, v in enumerate(eqn.invars)
                 if not isinstance(v, jex_core.Literal) and v is var]
    if not positions:
      continue
    path = base + scopes.scope_names(eqn.source_info.name_stack)
    name = eqn.primitive.name
    if name == "convert_element_type" and scopes.is_agreement_cast(path):
      verdict = _uses(jaxpr, eqn.outvars[0], rules, base, found)  # dropped
    elif name in MATMUL_OPS and max(positions) <= 1:
      verdict = _read_in(rules.region(path).matmul, positions, found)
    elif name == "convert_element_type":
      if pulled is None:
        pulled = pulled_into_fp32(jaxpr, rules.fp32_ops)
      # A cast the interpreter runs in fp32 (it only feeds fp32 ops) is no
      # half read.
      verdict = (_NOT_ONLY_GEMMS if index in pulled else
                 _read_in(eqn.params["new_dtype"], positions, found))
    elif name in LAYOUT_OPS and positions == [0]:
      verdict = _uses(jaxpr, eqn.outvars[0], rules, base, found)
    elif name in _CALLS and tracing.is_jaxpr(eqn.params.get(_CALLS[name])):
      verdict = _uses_in_call(eqn, positions, rules, path, found)
    else:
      verdict = _NOT_ONLY_GEMMS
    if verdict is _NOT_ONLY_GEMMS:
      return _NOT_ONLY_GEMMS
  return None


def _read_in(dtype, positions, found: list):
  if dtype is None or not is_half(dtype):
    return _NOT_ONLY_GEMMS
  found.extend([np.dtype(dtype)] * len(positions))
  return None


def _uses_in_call(eqn, positions, rules, path, found: list):
  sub, sub_consts = tracing.open_jaxpr(eqn.params[_CALLS[eqn.primitive.name]])
  _, invars = compat.jaxpr_inputs(sub, sub_consts)
  if len(invars) != len(eqn.invars):
    return _NOT_ONLY_GEMMS
  for i in positions:
    if _uses(sub, invars[i], rules, path, found) is _NOT_ONLY_GEMMS:
      return _NOT_ONLY_GEMMS
  return None


def pulled_into_fp32(jaxpr, fp32_ops: frozenset) -> set[int]:
  """The equations that only feed fp32 ops: they run in fp32 too.

  ``jax.nn.softmax(x)`` is ``exp(x - max(x)) / sum(...)``. Run as written
  from bf16 ``x``, ``x - max(x)`` would be rounded to bf16 before ``exp``
  saw it. An op (elementwise, a layout change or a cast) whose every result
  is used only by fp32 ops, or by ops pulled in this way, runs in fp32 from
  its half inputs, so the whole softmax, logsumexp or norm statistic is
  computed in fp32, as torch computes its fused ops. A value that is also
  used elsewhere (a residual stream) keeps its dtype: only the fp32 ops
  see it upcast.
  """
  uses: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for var in eqn.invars:
      if not isinstance(var, jex_core.Literal):
        uses.setdefault(var, []).append(i)
  for var in jaxpr.outvars:
    if not isinstance(var, jex_core.Literal):
      uses.setdefault(var, []).append(-1)
  pulled: set = set()

  def feeds_fp32(var) -> bool:
    if isinstance(var, jex_core.DropVar):
      return True
    users = uses.get(var, ())
    return bool(users) and all(
        i >= 0 and (i in pulled or jaxpr.eqns[i].primitive.name in fp32_ops)
        for i in users)

  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    name = eqn.primitive.name
    if name in fp32_ops or not (name in COMPUTE_OPS
                                or name == "convert_element_type"):
      continue
    floating = [v for v in eqn.outvars
                if is_floating(getattr(v.aval, "dtype", None))]
    if floating and all(feeds_fp32(v) for v in floating):
      pulled.add(i)
  return pulled


__all__ = ["LAYOUT_OPS", "half_gemm_operand", "pulled_into_fp32"]
