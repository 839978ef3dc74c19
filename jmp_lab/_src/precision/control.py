"""Handlers of primitives with sub-jaxprs: calls, custom derivatives,
loops, branches, remat and ``shard_map``.

Each is rebuilt with jax's own public transformation (``jax.custom_jvp``,
``jax.custom_vjp``, ``lax.scan``, ``lax.while_loop``, ``lax.switch``,
``jax.checkpoint``, ``jax.shard_map``) around a body the interpreter
evaluates, so values cross the boundary in the dtypes the rules chose: the
half ``relu(x @ w)`` stays half, and a loop's carry takes the dtype its body
computes (found by tracing the body until the carry's type is stable). A
``jit`` without shardings of its own is inlined. Custom derivative rules are
kept, their matmuls reached too. Pallas kernels choose their own precision
and run as written. A primitive this module cannot rebuild has its
sub-jaxprs rewritten with their written types (values cross in the dtypes
the code wrote); one it cannot rewrite runs as written, and a warning names
it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab import _compat as compat
from jmp_lab._src.numerics import product_remat
from jmp_lab._src.precision import (observers, reads, scopes, table,
                                    tracing)
from jmp_lab._src.precision.ops import MATMUL_OPS
from jmp_lab._src.precision.values import (Op, Role, as_written, aval, bind,
                                           dtype_of,
                                           is_array, is_floating, is_half,
                                           restore,
                                           role_of_result, roles_by_dtype,
                                           written_dtype)

# jit-like calls: inlined, so that values cross them in the dtypes the rules
# gave (jnp wraps many of its helpers, such as jnp.where, in a jit).
INLINED_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Higher-order primitives left alone: a Pallas kernel chooses its precision.
OPAQUE = frozenset({"pallas_call", "custom_partitioning", "run_state"})


class _CannotRebuild(Exception):
  pass


def handler_for(eqn) -> Optional[Callable[[Op], tuple[list, list]]]:
  """The handler of a higher-order primitive, or None for a first-order
  one."""
  name = eqn.primitive.name
  if name in OPAQUE:
    return as_written
  if name in INLINED_CALLS and _inlinable(eqn):
    return inlined
  if name in _REBUILT:
    return functools.partial(_rebuilt_or_same_types, _REBUILT[name])
  if tracing.has_subjaxprs(eqn):
    return same_types
  return None


def _rebuilt_or_same_types(rebuild, op: Op) -> tuple[list, list]:
  try:
    return rebuild(op)
  except _CannotRebuild:
    return same_types(op)


def _inlinable(eqn) -> bool:
  """A jit call without shardings of its own: inlined."""
  for key in ("in_shardings", "out_shardings"):
    for sharding in eqn.params.get(key, ()):
      if type(sharding).__name__ not in ("UnspecifiedValue", "NoneType"):
        return False
  return True


def inlined(op: Op) -> tuple[list, list]:
  inner = op.eqn.params.get("jaxpr", op.eqn.params.get("call_jaxpr"))
  jaxpr, consts = tracing.open_jaxpr(inner)
  context = op.context.inside(op.path)
  return context.evaluate(jaxpr, consts, op.invals, op.roles, context)


def _evaluator(jaxpr, consts, roles, context, box: dict) -> Callable:
  """A function of the jaxpr's inputs that evaluates it under the rules and
  keeps its output roles in ``box["roles"]``."""

  def evaluate(*args):
    outs, out_roles = context.evaluate(jaxpr, consts, args, roles, context)
    box["roles"] = out_roles
    return outs

  return evaluate


def _abstract(jaxpr, consts, in_avals, roles, context) -> tuple[list, list]:
  """The output types and roles of ``jaxpr`` under the rules, from an
  abstract trace that reports nothing."""
  box: dict = {}
  with observers.muted():
    traced, _ = tracing.trace(_evaluator(jaxpr, consts, roles, context, box),
                              in_avals, None)
  return [v.aval for v in traced.outvars], box["roles"]


def _typed(value: Any, dtype: Any) -> Any:
  """``value`` as a strongly typed array in ``dtype`` (floating only)."""
  if dtype is None or not is_floating(dtype):
    return value
  return jnp.asarray(value, dtype=dtype)


# ---- custom derivatives -----------------------------------------------------


def custom_jvp(op: Op) -> tuple[list, list]:
  """A ``custom_jvp`` function at the dtypes the rules chose, its JVP rule
  evaluated under the rules too."""
  params = op.eqn.params
  if params.get("symbolic_zeros") or "jvp_jaxpr_fun" not in params:
    raise _CannotRebuild
  nconsts, jvp_fun = params["num_consts"], params["jvp_jaxpr_fun"]
  context = op.context.inside(op.path)
  jaxpr, consts = tracing.open_jaxpr(params["call_jaxpr"])
  box: dict = {}
  primal = _evaluator(jaxpr, consts, op.roles, context, box)
  with observers.muted():
    want = jax.eval_shape(lambda *a: tuple(primal(*a)), *op.invals)
  roles = op.roles[nconsts:]

  def jvp(primals, tangents):
    nonzero = [False] * (len(primals) - nconsts)
    rule, rule_consts, out_zeros = jvp_fun.call_wrapped(*nonzero)
    outs, _ = context.evaluate(rule, rule_consts,
                               [*primals[nconsts:], *tangents[nconsts:]],
                               [*roles, *roles], context)
    primal_out = [_typed(o, w.dtype) for o, w in zip(outs, want)]
    nonzero_out = iter(outs[len(out_zeros):])
    tangent_out = [_zero_tangent(w) if zero else
                   _typed(next(nonzero_out), _tangent_dtype(w))
                   for w, zero in zip(want, out_zeros)]
    return tuple(primal_out), tuple(tangent_out)

  rebuilt = jax.custom_jvp(lambda *args: tuple(primal(*args)))
  rebuilt.defjvp(jvp)
  outs = list(rebuilt(*op.invals))
  return outs, list(box.get("roles") or roles_by_dtype(outs))


def _tangent_dtype(aval_) -> Any:
  return aval_.dtype if is_floating(aval_.dtype) else jax.dtypes.float0


def _zero_tangent(aval_) -> Any:
  return np.zeros(aval_.shape, _tangent_dtype(aval_))


def custom_vjp(op: Op) -> tuple[list, list]:
  """A ``custom_vjp`` function at the dtypes the rules chose: its forward
  rule under the rules, its backward rule too (nothing inside is
  transposed, so matmuls keep the accumulation dtype they ask for)."""
  params = op.eqn.params
  needed = ("call_jaxpr", "fwd_jaxpr_thunk", "bwd", "out_trees", "num_consts")
  if params.get("symbolic_zeros") or not all(k in params for k in needed):
    raise _CannotRebuild
  nconsts = params["num_consts"]
  fwd, bwd, out_trees = (params["fwd_jaxpr_thunk"], params["bwd"],
                         params["out_trees"])
  context = op.context.inside(op.path, transposable=False)
  jaxpr, consts = tracing.open_jaxpr(params["call_jaxpr"])
  box: dict = {}
  primal = _evaluator(jaxpr, consts, op.roles, context, box)
  with observers.muted():
    want = jax.eval_shape(lambda *a: tuple(primal(*a)), *op.invals)
  roles = op.roles[nconsts:]

  arg_dtypes = [dtype_of(a) for a in op.invals[nconsts:]]
  written: dict = {}  # the types the backward rule was written for

  def forward(*args):
    primals = args[nconsts:]
    rule, rule_consts = fwd.call_wrapped(*([True] * len(primals)))
    outs, _ = context.evaluate(rule, rule_consts, primals, roles, context)
    _, rule_invars = compat.jaxpr_inputs(rule, rule_consts)
    npruned = len(outs) - len(want)
    trees = out_trees()
    forwards = (trees[2] if len(trees) > 2
                else [None] * trees[1].num_leaves)
    pruned = iter(zip(outs[:npruned], rule.outvars[:npruned]))
    residuals, written["residuals"] = [], []
    for i in forwards:
      # jax numbers a forwarded input among all of the call's arguments,
      # the closed-over constants first; the rule's inputs are the primals.
      value, var = ((primals[i - nconsts], rule_invars[i - nconsts])
                    if i is not None else next(pruned))
      residuals.append(value)
      written["residuals"].append(var)
    written["outputs"] = rule.outvars[npruned:]
    primal_out = [_typed(o, w.dtype) for o, w in zip(outs[npruned:], want)]
    return tuple(primal_out), tuple(residuals)

  def backward(residuals, cotangents):
    # The rule runs on the types it was written for (jax checks what it
    # returns against them) and under the rules inside.
    args = ([restore(r, v) for r, v in zip(residuals, written["residuals"])]
            + [restore(c, v) for c, v in zip(cotangents, written["outputs"])])
    cts = _call_under_rules(
        lambda *a: compat.custom_vjp_cotangents(bwd.call_wrapped(*a),
                                                len(arg_dtypes)), args,
        context)
    cts = [_typed(c, d) if is_array(c) and is_floating(d) else None
           for c, d in zip(cts, arg_dtypes)]
    return (None,) * nconsts + tuple(cts)

  rebuilt = jax.custom_vjp(lambda *args: tuple(primal(*args)))
  rebuilt.defvjp(forward, backward)
  outs = list(rebuilt(*op.invals))
  return outs, list(box.get("roles") or roles_by_dtype(outs))


def _call_under_rules(fun, args, context):
  """``fun(*args)`` (a custom_vjp's backward rule) under the rules."""
  if not all(is_array(a) for a in args):
    return fun(*args)  # symbolic zeros: left as written
  layout = {}

  def traced(*values):
    outs = list(fun(*values))
    layout["outs"] = outs
    return [o for o in outs if is_array(o)]

  jaxpr, consts = tracing.trace(traced, [aval(a) for a in args], None)
  results, _ = context.evaluate(jaxpr, consts, args, roles_by_dtype(args),
                                context)
  results = iter(results)
  return [next(results) if is_array(o) else o for o in layout["outs"]]


# ---- loops and branches -----------------------------------------------------


def _stable_carry(body, consts_avals, carry, x_avals, roles_before,
                  roles_after, context):
  """The carry types (dtype, role) that the body hands back unchanged:
  start from the initial value's and take the body's until they agree."""
  jaxpr, body_consts = body
  for _ in range(4):
    in_avals = (consts_avals + [a.update(dtype=d, weak_type=False)
                                if is_floating(d) else a
                                for a, (d, _) in carry] + x_avals)
    roles = roles_before + [r for _, (_, r) in carry] + roles_after
    out_avals, out_roles = _abstract(jaxpr, body_consts, in_avals, roles,
                                     context)
    new = [(a, (o.dtype if is_floating(d) else d, r if is_floating(d)
                else Role.STORED))
           for (a, (d, _)), o, r in zip(carry, out_avals, out_roles)]
    if [t for _, t in new] == [t for _, t in carry]:
      return carry, out_roles
    carry = new
  raise _CannotRebuild


def scan(op: Op) -> tuple[list, list]:
  """``lax.scan`` with its carry in the dtype its body computes."""
  params = op.eqn.params
  nconsts, ncarry = compat.scan_counts(params)
  consts, init, xs = (op.invals[:nconsts], op.invals[nconsts:nconsts + ncarry],
                      op.invals[nconsts + ncarry:])
  croles, iroles, xroles = (op.roles[:nconsts],
                            op.roles[nconsts:nconsts + ncarry],
                            op.roles[nconsts + ncarry:])
  context = op.context.inside(op.path)
  body = tracing.open_jaxpr(params["jaxpr"])
  stacked = xs
  xs = _hoisted_casts(body, nconsts + ncarry, xs, xroles, context)
  x_avals = [aval(x).update(shape=aval(x).shape[1:]) for x in xs]
  carry = [(aval(x), (dtype_of(x), r)) for x, r in zip(init, iroles)]
  carry, _ = _stable_carry(body, [aval(c) for c in consts], carry, x_avals,
                           list(croles), list(xroles), context)
  dtypes = [d for _, (d, _) in carry]
  roles = list(croles) + [r for _, (_, r) in carry] + list(xroles)
  box: dict = {}

  def step(carry_in, x):
    context.mark_slices(stacked, x)
    outs, out_roles = context.evaluate(*body, [*consts, *carry_in, *x], roles,
                                       context)
    box["roles"] = out_roles
    return ([_typed(o, d) for o, d in zip(outs[:ncarry], dtypes)],
            outs[ncarry:])

  final, ys = jax.lax.scan(step, [_typed(x, d) for x, d in zip(init, dtypes)],
                           list(xs), length=params["length"],
                           reverse=params["reverse"], unroll=params["unroll"])
  return list(final) + list(ys), [r for _, (_, r) in carry] + box["roles"][
      ncarry:]


def _hoisted_casts(body, first: int, xs: list, roles: list,
                   context) -> list:
  """The stacked inputs that only half GEMMs read in the body (layers'
  kernels), cast to that dtype before the loop: the same values, half
  the bytes in the loop's copies and its stacked gradients
  (:mod:`.reads`)."""
  jaxpr, consts = body
  hoisted = []
  for i, (x, role) in enumerate(zip(xs, roles)):
    dtype = dtype_of(x)
    if role == Role.STORED and is_floating(dtype) and not is_half(dtype):
      half = reads.half_gemm_operand(jaxpr, consts, first + i,
                                        context.rules, context.base)
      if half is not None:
        x = jax.lax.convert_element_type(x, half)
    hoisted.append(x)
  return hoisted


def while_loop(op: Op) -> tuple[list, list]:
  """``lax.while_loop`` with its carry in the dtype its body computes."""
  params = op.eqn.params
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cconsts, bconsts, init = (op.invals[:nc], op.invals[nc:nc + nb],
                            op.invals[nc + nb:])
  croles, broles, iroles = (op.roles[:nc], op.roles[nc:nc + nb],
                            op.roles[nc + nb:])
  context = op.context.inside(op.path)
  body = tracing.open_jaxpr(params["body_jaxpr"])
  cond = tracing.open_jaxpr(params["cond_jaxpr"])
  carry = [(aval(x), (dtype_of(x), r)) for x, r in zip(init, iroles)]
  carry, _ = _stable_carry(body, [aval(c) for c in bconsts], carry, [],
                           list(broles), [], context)
  dtypes = [d for _, (d, _) in carry]
  carry_roles = [r for _, (_, r) in carry]

  def keep_going(values):
    outs, _ = context.evaluate(*cond, [*cconsts, *values],
                               list(croles) + carry_roles, context)
    return outs[0]

  def step(values):
    outs, _ = context.evaluate(*body, [*bconsts, *values],
                               list(broles) + carry_roles, context)
    return [_typed(o, d) for o, d in zip(outs, dtypes)]

  final = jax.lax.while_loop(keep_going, step,
                             [_typed(x, d) for x, d in zip(init, dtypes)])
  return list(final), carry_roles


def switch(op: Op) -> tuple[list, list]:
  """``cond`` with each output in the widest dtype its branches compute it
  in. Its index is bound as it is: a ``lax.platform_dependent`` choice stays
  one that the lowering makes (only the platform's branch is lowered)."""
  from jax.extend import core as jex_core
  index, operands = op.invals[0], op.invals[1:]
  roles = op.roles[1:]
  context = op.context.inside(op.path)
  branches = [tracing.open_jaxpr(b) for b in op.eqn.params["branches"]]
  in_avals = [aval(x) for x in operands]
  found = [_abstract(*b, in_avals, roles, context) for b in branches]
  dtypes, out_roles = [], []
  for outs in zip(*[avals for avals, _ in found]):
    floating = [o.dtype for o in outs if is_floating(o.dtype)]
    dtypes.append(functools.reduce(jnp.promote_types, floating)
                  if floating else None)
  for per_output in zip(*[r for _, r in found]):
    out_roles.append(max(per_output))

  def typed_branch(jaxpr, consts):
    def run(*args):
      outs, _ = context.evaluate(jaxpr, consts, args, roles, context)
      return [_typed(o, d) for o, d in zip(outs, dtypes)]
    return jex_core.ClosedJaxpr(*tracing.trace(run, in_avals, None))

  params = dict(op.eqn.params, branches=tuple(typed_branch(*b)
                                               for b in branches))
  return bind(op.eqn, [index, *operands], params), out_roles


def checkpoint(op: Op) -> tuple[list, list]:
  """``jax.checkpoint`` around the body under the rules."""
  params = op.eqn.params
  if params.get("differentiated") or "prevent_cse" not in params:
    raise _CannotRebuild
  context = op.context.inside(op.path)
  jaxpr, consts = tracing.open_jaxpr(params["jaxpr"])
  box: dict = {}
  body = _evaluator(jaxpr, consts, op.roles, context, box)
  # The body's block-scaled products are asked of the policy as the
  # dot_generals they stand for (a policy that saves dots saves them).
  policy = product_remat.checkpoint_policy(params.get("policy"))
  outs = jax.checkpoint(body, prevent_cse=params["prevent_cse"],
                        policy=policy)(*op.invals)
  return list(outs), box["roles"]


def shard_map(op: Op) -> tuple[list, list]:
  """``jax.shard_map`` around the body under the rules."""
  params = op.eqn.params
  context = op.context.inside(op.path)
  body = params["jaxpr"]
  box: dict = {}
  evaluate = _evaluator(*tracing.open_jaxpr(body), op.roles, context, box)
  try:
    mapped = jax.shard_map(
        lambda *shards: tuple(evaluate(*shards)), mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]), check_vma=params["check_vma"],
        axis_names=set(params.get("newly_manual_axes",
                                  params.get("manual_axes", ()))))
  except (KeyError, TypeError) as e:
    op.context.unreached("shard_map", op.path, f"not rebuilt: {e}")
    return as_written(op)
  outs = list(mapped(*op.invals))
  return outs, box["roles"]


# ---- sub-jaxprs rewritten with their written types --------------------------


def same_types(op: Op) -> tuple[list, list]:
  """Binds the equation with its sub-jaxprs rewritten under the rules;
  values cross it in the dtypes the code wrote."""
  args = [restore(x, v) for x, v in zip(op.invals, op.eqn.invars)]
  context = op.context.inside(op.path)
  try:
    params = _same_type_params(op.eqn.params, context)
  except _CannotRebuild as e:
    inside = sorted({scopes.user_path(scopes.scope_names(
        m.source_info.name_stack)) for m in _matmuls_in(op.eqn.params)}
                    - {""})
    op.context.unreached(op.name, op.path, str(e) + (
        f"; its matmuls under {', '.join(map(repr, inside))} stay as written"
        if inside else ""))
    params = op.eqn.params
  outs = bind(op.eqn, args, params)
  inputs = [r for r, v in zip(op.roles, op.eqn.invars) if written_dtype(v)]
  return outs, [role_of_result(o, inputs) for o in outs]


def _same_type_params(params: dict, context) -> dict:
  new = {}
  for key, value in params.items():
    if tracing.is_jaxpr(value):
      new[key] = _rewrite_jaxpr(value, context)
    elif isinstance(value, (tuple, list)) and value and all(
        tracing.is_jaxpr(v) for v in value):
      new[key] = type(value)(_rewrite_jaxpr(v, context) for v in value)
    else:
      new[key] = value
  return new


def _rewrite_jaxpr(closed, context):
  """A jaxpr (closed or open) with the same types, evaluated under the
  rules."""
  from jax.extend import core as jex_core
  jaxpr, consts = tracing.open_jaxpr(closed)

  def body(*args):
    outs, _ = context.evaluate(jaxpr, consts, args, roles_by_dtype(args),
                               context)
    return [restore(x, v) for x, v in zip(outs, jaxpr.outvars)]

  new_jaxpr, new_consts = tracing.trace(
      body, [v.aval for v in jaxpr.invars], jaxpr.debug_info)
  if tracing.is_closed(closed):
    return jex_core.ClosedJaxpr(new_jaxpr, new_consts)
  if new_consts:
    raise _CannotRebuild("its rewritten body closes over constants")
  return new_jaxpr


def _matmuls_in(params) -> list:
  """The matmul equations inside an equation's sub-jaxprs (for warnings)."""
  found = []
  for sub in tracing.sub_jaxprs(params):
    jaxpr, _ = tracing.open_jaxpr(sub)
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in MATMUL_OPS:
        found.append(eqn)
      found += _matmuls_in(eqn.params)
  return found


_REBUILT = {
    "custom_jvp_call": custom_jvp,
    "custom_vjp_call": custom_vjp,
    "scan": scan,
    "while": while_loop,
    "cond": switch,
    "remat2": checkpoint,
    "checkpoint": checkpoint,
    "shard_map": shard_map,
}

table.higher_order = handler_for
