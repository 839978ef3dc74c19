"""One handler per kind of first-order primitive: the op rules as code.

A handler takes an :class:`Op` (an equation, its input values and their
roles, the region it runs in) and returns its output values and their
roles (:class:`~.values.Role`). :func:`handler_for` is the table: matmuls,
casts, fp32 ops, compute ops, integer-built values, and everything else as
written. Higher-order primitives (``scan``, ``custom_jvp_call``...) have
their handlers in :mod:`.control`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_lab import _gemm
from jmp_lab._src.matmuls import BLOCK_QUANTIZE_SCOPE
from jmp_lab._src.numerics import block_matmul, fp8_matmul
from jmp_lab._src.precision import observers, scopes, table
from jmp_lab._src.precision.ops import COMPUTE_OPS, MATMUL_OPS
from jmp_lab._src.precision.values import (F32, Handler, Op, Role, as_written,
                                           bind, cast, dtype_of, is_half,
                                           is_floating, restore, written_dtype)


def matmul(op: Op) -> tuple[list, list]:
  """Both operands in the region's matmul dtype; fp32 accumulation. In a
  block-scaled region, a weight matmul is block-scaled; in a module whose
  policy has ``matmul=fp8_current``, its own weight matmul is an fp8 GEMM
  (``matmul=fp8``'s delayed scaling is warned of)."""
  target = op.region.matmul
  written = [written_dtype(v) for v in op.eqn.invars[:2]]
  actual = [dtype_of(x, v) for x, v in zip(op.invals, op.eqn.invars)][:2]
  weight = _weight_operand(op, target, actual)
  if weight is not None and op.region.fp8 == "fp8":
    observers.fp8_unreached(scopes.user_path(op.path))
  elif weight is not None:
    observers.matmul_ran([target, target], written, False, in_model=True)
    lhs, rhs = (cast(v, target) for v in op.invals[:2])
    dimension_numbers = op.eqn.params["dimension_numbers"]
    if op.region.fp8 == "fp8_current":
      return [fp8_matmul.current_dot_general(lhs, rhs, dimension_numbers)
              ], [Role.HALF]
    return [block_matmul.dot_general(
        lhs, rhs, dimension_numbers, fmt=op.region.block_scaled,
        weight=weight)], [Role.HALF]
  if target is None or not all(is_floating(d) and d.itemsize > 1
                               for d in actual):
    dtypes = [np.dtype(v.aval.dtype) for v in op.eqn.invars[:2]]
    observers.matmul_ran(dtypes, dtypes, False,
                         in_model=op.region.compute is not None)
    return as_written(op)  # as written, or integer or fp8: not ours
  observers.matmul_ran([target, target], written, op.region.compute is None,
                       in_model=op.region.compute is not None)
  operands = [cast(x, target) for x in op.invals[:2]]
  rest = list(op.invals[2:])
  params = dict(op.eqn.params)
  if (written != [target, target] and op.context.transposable
      and "preferred_element_type" in params):
    # The result in the compute dtype (the GEMM accumulates in fp32): an
    # fp32 result would make jax's transpose a GEMM of an fp32 cotangent by
    # a half operand, which runs in fp32.
    params["preferred_element_type"] = target
  result = params.get("preferred_element_type")
  if result is None or np.dtype(result).itemsize <= target.itemsize:
    return bind(op.eqn, operands + rest, params), [Role.HALF]
  # Half operands, a wider result (a backward rule's fp32 accumulation):
  # XLA:CPU cannot run every such GEMM (jmp_lab._gemm).
  out = _gemm.accumulated(
      lambda *xs: bind(op.eqn, list(xs) + rest, params)[0], operands, result)
  return [out], [Role.WIDE]


def _weight_operand(op: Op, target, actual) -> Optional[str]:
  """Which operand of ``op`` is the weight, if ``op`` is a weight matmul of
  a block-scaled (or a module's fp8) region: a ``dot_general`` of floating
  operands one of
  which is stored, or is a param a front end read (a module's own
  ``x @ kernel.T``: :meth:`~.values.Context.mark_weights`). ``"rhs"`` for
  ``x @ w``, and when both are stored (a layer applied to an argument of
  the function); ``"lhs"`` for ``w @ x`` (Equinox's ``Linear``) where ``w``
  is an input as handed in or a param: a stored value the code built (a
  causal mask, a one-hot dispatch matrix, a constant table) is not taken
  for a weight on the left. None: not one."""
  if ((op.region.block_scaled is None and op.region.fp8 is None)
      or target is None
      or op.eqn.primitive.name != "dot_general"
      or not all(is_floating(d) and d.itemsize > 1 for d in actual)
      # jmp_lab's own quantization (the Hadamard transform's small GEMM)
      # inside a block-scaled product the code called itself.
      or BLOCK_QUANTIZE_SCOPE in op.path):
    return None
  if op.roles[1] == Role.STORED or op.context.is_weight(op.invals[1]):
    return "rhs"
  left = op.eqn.invars[0]
  handed_in = (not isinstance(left, jex_core.Literal)  # (not hashable)
               and left in op.context.inputs)
  if (op.roles[0] == Role.STORED and handed_in) or op.context.is_weight(
      op.invals[0]):
    return "lhs"
  return None


def convert(op: Op) -> tuple[list, list]:
  """A cast the code wrote: an explicit upcast of a computed half value is
  honoured (fp32 because the code asked), and so is a later cast back; a
  cast to half of an fp32-op result is deferred (``jnp.mean`` of bf16 casts
  its fp32 sum back); a cast of a stored value only changes its stored
  dtype; values built from integers stay fp32; a front end's cast
  (:func:`~.scopes.policy_cast_scope`) is a decision and is kept."""
  (x,), (role,) = op.invals, op.roles
  if scopes.is_agreement_cast(op.path):
    return [x], [role]  # only there to type-check the trace (agreement.py)
  source = op.eqn.invars[0].aval.dtype
  new = np.dtype(op.eqn.params["new_dtype"]) if _is_numpy(
      op.eqn.params["new_dtype"]) else None
  by_target = Role.HALF if is_half(new) else Role.WIDE
  if new is None or not is_floating(new):
    return bind(op.eqn, [restore(x, op.eqn.invars[0])]), [Role.STORED]
  if not is_floating(source):
    if _is_numpy(source) and jnp.issubdtype(source, jnp.floating):
      return bind(op.eqn, [x]), [by_target]  # an fp8 value, dequantized
    # Built from integers (positions) stays fp32; a boolean mask is exact.
    built = Role.STORED if np.dtype(source) == np.dtype(bool) else Role.WIDE
    return bind(op.eqn, [x]), [built]
  if scopes.is_policy_cast(op.path):
    return bind(op.eqn, [x]), [by_target]
  if role == Role.STORED:
    return bind(op.eqn, [x]), [Role.STORED]
  if role == Role.FP32 and is_half(new):
    return [x], [Role.FP32]
  return bind(op.eqn, [x]), [Role.FP32 if role == Role.FP32 else by_target]


def _is_numpy(dtype) -> bool:
  try:
    np.dtype(dtype)
    return True
  except TypeError:  # an extended dtype (a PRNG key's)
    return False


def _groups(op: Op) -> dict:
  """The floating inputs, grouped by the dtype the code wrote for them (an
  op such as ``select_n`` needs its cases in one dtype)."""
  groups: dict = {}
  for i, var in enumerate(op.eqn.invars):
    written = written_dtype(var)
    if written is not None:
      groups.setdefault(written, []).append(i)
  return groups


def compute(op: Op) -> tuple[list, list]:
  """In the compute dtype, stored inputs read in it; an fp32-by-rule input
  makes the op run in fp32 (torch's promotion); stored inputs alone: in the
  widest dtype they hold (as written, unless an fp32 op computed one), a
  stored result."""
  args, out_role = list(op.invals), Role.STORED
  for members in _groups(op).values():
    top = max(op.roles[i] for i in members)
    actual = [dtype_of(op.invals[i], op.eqn.invars[i]) for i in members]
    if top == Role.HALF:
      target = op.region.compute
    else:  # the widest of the deciding inputs (all of them if stored)
      target = functools.reduce(jnp.promote_types, [
          d for i, d in zip(members, actual)
          if op.roles[i] >= min(top, Role.WIDE)])
    args = [cast(x, target) if i in members else x for i, x in enumerate(args)]
    out_role = max(out_role, top)
  try:
    outs = bind(op.eqn, args)
  except (TypeError, ValueError):  # the op insists on its written dtypes
    return as_written(op)
  return outs, [out_role if is_floating(dtype_of(o)) else Role.STORED
                for o in outs]


def into_destination(op: Op) -> tuple[list, list]:
  """A write into a buffer (``dynamic_update_slice``, ``scatter``): the
  written value takes the buffer's dtype, as torch.autocast's in-place
  copies do, so a float32 cache stays float32 whatever dtype the policy
  computed its new entries in. The result's role is the buffer's or the
  written value's, whichever decides more: a stored buffer written with
  half values reads as half, one written with fp32 values (rotary angles
  built from integers) stays fp32."""
  buffer, value_index = op.invals[0], _WRITTEN_VALUE[op.name]
  dtype = dtype_of(buffer, op.eqn.invars[0])
  if not is_floating(dtype):
    return as_written(op)
  args = list(op.invals)
  args[value_index] = cast(args[value_index], dtype)
  try:
    outs = bind(op.eqn, args)
  except (TypeError, ValueError):
    return as_written(op)
  return outs, [max(op.roles[0], op.roles[value_index])]


# Which input a write's new values are (the buffer is input 0).
_WRITTEN_VALUE = {"dynamic_update_slice": 1, "scatter": 2, "scatter-add": 2,
                  "scatter_add": 2, "scatter-sub": 2, "scatter_sub": 2,
                  "scatter-mul": 2, "scatter_mul": 2, "scatter-min": 2,
                  "scatter_min": 2, "scatter-max": 2, "scatter_max": 2}


def fp32(op: Op) -> tuple[list, list]:
  """An fp32 op: its inputs read in fp32 (half ones cast up), an fp32
  result (a stored one from stored inputs alone)."""
  return in_fp32(op)


def in_fp32(op: Op) -> tuple[list, list]:
  """The op in fp32: half inputs cast up; a cast to half keeps fp32."""
  if op.name == "convert_element_type":
    target = jnp.promote_types(F32, op.eqn.params["new_dtype"])
    return [cast(op.invals[0], target)], [Role.FP32]
  floating = [written_dtype(v) is not None for v in op.eqn.invars]
  args = [cast(x, F32) if f and is_half(dtype_of(x, v)) else x
          for f, x, v in zip(floating, op.invals, op.eqn.invars)]
  try:
    outs = bind(op.eqn, args)
  except (TypeError, ValueError):
    return compute(op)
  if not any(f and r != Role.STORED for f, r in zip(floating, op.roles)):
    return outs, [Role.STORED] * len(outs)
  return outs, [Role.FP32 if is_floating(dtype_of(o)) else Role.STORED
                for o in outs]


def from_integers(op: Op) -> tuple[list, list]:
  """``iota`` in a floating dtype: positions, which stay fp32."""
  outs = bind(op.eqn, op.invals)
  return outs, [Role.WIDE if is_floating(dtype_of(o)) else Role.STORED
                for o in outs]


_FIRST_ORDER: dict[str, Handler] = {
    **{name: compute for name in COMPUTE_OPS},
    **{name: matmul for name in MATMUL_OPS},
    "convert_element_type": convert,
    "iota": from_integers,
    **{name: into_destination for name in _WRITTEN_VALUE},
}


def handler_for(name: str, region: scopes.Region, rules,
                pulled: bool) -> Handler:
  """The handler of a first-order primitive in ``region`` (``rules``: the
  op rules, whose ``fp32_ops`` it reads)."""
  if name in MATMUL_OPS:
    return matmul
  if region.compute is None:
    return as_written
  if pulled:
    return in_fp32
  if name in rules.fp32_ops:
    return fp32
  return _FIRST_ORDER.get(name, as_written)


table.first_order = handler_for
