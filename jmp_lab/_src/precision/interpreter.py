"""The jaxpr interpreter: a function re-evaluated op by op under the rules.

:func:`apply_rules` traces a function to a jaxpr and evaluates it again,
like ``jax.core.eval_jaxpr``, handing each equation to its handler
(:mod:`.handlers` for first-order primitives, :mod:`.control` for those with
sub-jaxprs). It tracks each value's role (:mod:`.values`). Re-interpreting
the jaxpr, rather than intercepting ``lax`` functions as qwix does, reaches
every op: the ``dot_general`` inside ``jnp.einsum``, jitted helpers whose
traces jax cached, and code that calls ``lax`` directly.

This module reads some of jax's internals, as ``jax.core.eval_jaxpr`` does:
equations, their bind parameters and name stacks. A sub-jaxpr it cannot
rewrite runs as written, and a warning names it.

A function of NNX objects (a model's call, a train step's loss) goes through
:func:`call_under_rules`: traced as a pure function of their state, as NNX's
own transforms do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jex_core
from jax.extend import source_info_util as _source_info

from jmp_lab import _compat as compat
from jmp_lab._nesting import Nesting
from jmp_lab._src.precision import agreement, observers, scopes, table
from jmp_lab._src.precision.reads import pulled_into_fp32
from jmp_lab._src.precision.tracing import trace
from jmp_lab._src.precision.values import (Context, Op, Role, aval, cast,
                                           dtype_of,
                                           is_array, is_floating)

# Whether user code is being traced by apply_rules on this thread (a front
# end asks, to run a model's own call only once under the rules).
_TRACING = Nesting()


def is_tracing() -> bool:
  """Whether the calling code is being traced under the rules."""
  return _TRACING.active


def apply_rules(fn: Callable[..., Any], rules: Any, *,
                output_dtype: Any = None) -> Callable[..., Any]:
  """``fn`` evaluated under ``rules``; floating outputs cast to
  ``output_dtype`` (None: left as the rules made them). Array arguments are
  traced (stored values: read where used in the dtype the use computes
  in); other arguments are passed as they are. The function is traced
  inside the rules' own named scope, so code that asks
  :func:`~.scopes.current_compute_dtype` finds it."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
    outputs = {}

    def flat_fn(*values):
      full = list(leaves)
      for i, value in zip(dynamic, values):
        full[i] = value
      call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
      # A trace starts with an empty name stack: the rules' scope is opened
      # inside it, so the code traced finds it (current_compute_dtype).
      with _TRACING.enter(), _rules_scope(rules), agreement.agreeing():
        out = fn(*call_args, **call_kwargs)
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      outputs["tree"], outputs["leaves"] = out_tree, out_leaves
      return [x for x in out_leaves if is_array(x)]

    values = [leaves[i] for i in dynamic]
    jaxpr, consts = trace(flat_fn, [aval(x) for x in values], None)
    context = Context(rules, scopes.current_path(), transposable=True,
                      report={}, evaluate=evaluate)
    results, _ = evaluate(jaxpr, consts, values, [Role.STORED] * len(values),
                          context)
    # An output the trace folded to a literal comes back as an array.
    results = [x if is_array(x) else jnp.asarray(x, v.aval.dtype)
               for x, v in zip(results, jaxpr.outvars)]
    for (primitive, path), why in context.report.items():
      observers.unreached(primitive, path, why)
    if output_dtype is not None:
      results = [cast(x, output_dtype) if is_floating(dtype_of(x)) else x
                 for x in results]
    results = iter(results)
    return jax.tree_util.tree_unflatten(
        outputs["tree"], [next(results) if is_array(x) else x
                          for x in outputs["leaves"]])

  return wrapped


def outputs_in(tree: Any, dtype: Any) -> Any:
  """The floating arrays of ``tree`` cast to ``dtype`` (None: unchanged),
  NNX objects passed on. A front end casts its model's outputs where it
  traces them; this holds where the interpreter chose another dtype (an op
  whose inputs had to agree, :mod:`.agreement`)."""
  if dtype is None:
    return tree
  return jax.tree_util.tree_map(
      lambda x: cast(x, dtype) if is_array(x) and is_floating(dtype_of(x))
      else x, tree, is_leaf=is_nnx_object)


def _rules_scope(rules: Any):
  """The named scope of the rules' default region."""
  if rules.island:
    return scopes.island(rules.compute_dtype)
  return scopes.scope(rules.compute_dtype)


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any],
             roles: Sequence[Role], context: Context
             ) -> tuple[list[Any], list[Role]]:
  """Evaluates ``jaxpr`` under the rules: its output values (in the dtypes
  the rules gave them) and their roles. Constants are stored values."""
  env: dict = {}
  role: dict = {}
  constvars, invars = compat.jaxpr_inputs(jaxpr, consts)
  for var, value in zip(constvars, consts):
    env[var], role[var] = value, Role.STORED
  for var, value, r in zip(invars, args, roles):
    env[var], role[var] = value, r
  context = dataclasses.replace(context, inputs=frozenset(invars))

  def read(atom):
    if isinstance(atom, jex_core.Literal):
      return atom.val, Role.STORED
    return env[atom], role[atom]

  pulled = pulled_into_fp32(jaxpr, context.rules.fp32_ops)
  for index, eqn in enumerate(jaxpr.eqns):
    path = context.base + scopes.scope_names(eqn.source_info.name_stack)
    invals, inroles = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
    op = Op(eqn, list(invals), list(inroles), path,
            context.rules.region(path), index in pulled, context)
    name_stack = (_source_info.current_name_stack()
                  + eqn.source_info.name_stack)
    with _source_info.user_context(eqn.source_info.traceback,
                                   name_stack=name_stack), eqn.ctx.manager:
      outs, out_roles = _dispatch(op)
    context.mark_weights(op, outs)
    for var, value, r in zip(eqn.outvars, outs, out_roles):
      env[var], role[var] = value, r
  found = [read(v) for v in jaxpr.outvars]
  return [v for v, _ in found], [r for _, r in found]


def _dispatch(op: Op) -> tuple[list, list]:
  return table.handler(op)(op)


__all__ = ["apply_rules", "evaluate", "is_tracing", "outputs_in",
           "pulled_into_fp32"]


# ---------------------------------------------------------------------------
# NNX objects through the engine.
# ---------------------------------------------------------------------------


def is_nnx_object(x: Any) -> bool:
  """An NNX module, variable or other NNX object."""
  return isinstance(x, (nnx.Variable, nnx.Pytree))


def holds_nnx_objects(tree: Any) -> bool:
  """Whether ``tree`` holds an NNX module, variable or other NNX object."""
  return any(is_nnx_object(x) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=is_nnx_object))


def call_under_rules(fn: Callable, args: tuple, kwargs: dict, rules,
                     output_dtype: Any = None) -> Any:
  """``fn(*args, **kwargs)`` under the engine's ``rules``, NNX objects
  among the arguments included.

  The engine traces a pure function, so the module graphs (and any NNX
  object among the arguments, such as an ``nnx.Rngs``) are split, merged
  inside, and their new state (batch statistics, RNG counts) put back
  after: the pattern of NNX's own transforms. Floating outputs (not the
  state put back) are cast to ``output_dtype`` (None: as the rules made
  them).
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
  out = outputs_in(out, output_dtype)
  changed = _changed_variables(list(nnx.to_flat_state(state)),
                               list(nnx.to_flat_state(new_state)))
  if changed:
    nnx.update(tuple(nodes), nnx.from_flat_state(changed))
  return out


def _changed_variables(before: list, after: list) -> list:
  """The ``(path, variable)`` pairs of ``after`` that ``before`` lacks (a
  value the call sowed, a cache it made) or whose value is not the one in
  ``before``. Only these are put back: a plain forward pass writes
  nothing, so it may run inside ``jax.jit`` on a model made outside it, as
  a plain NNX module may; and one that sows writes its sown values alone,
  not the RNG counts it left as they were (NNX refuses to write those
  from inside a transform of a model merged there)."""
  def leaves(v):  # a tuple of sown values is rebuilt: compare its arrays
    return jax.tree_util.tree_leaves(
        v.get_raw_value() if isinstance(v, nnx.Variable) else v)

  old = {path: leaves(v) for path, v in before}
  return [(path, v) for path, v in after
          if path not in old or len(leaves(v)) != len(old[path])
          or any(a is not b for a, b in zip(leaves(v), old[path]))]
