"""What the interpreter knows of each value (its role, casts by role) and of
each equation it evaluates (:class:`Op`, :class:`Context`, binding).

A value's *role* says who decided its dtype:

* ``STORED``: nobody yet. Arguments, params, constants, literals, and what
  is computed from them alone. Every use reads it in the dtype that use
  computes in: a param is read in half by a half op, in fp32 by an fp32 op.
  A weakly typed literal is one, so it never promotes.
* ``HALF``: the rules computed it in a half dtype.
* ``WIDE``: fp32 because the code asked: what it explicitly upcast from
  half, and values built from integers (positions, rotary angles). A later
  cast back to half is honoured.
* ``FP32``: fp32 by rule: an fp32 op's result and what is computed from it
  (softmax, a norm's statistics, log-sum-exp). A cast back to half is
  deferred: ``jnp.mean`` of bf16 casts its fp32 result back internally.

An op that mixes a ``WIDE`` or ``FP32`` value with a half one runs in fp32,
as torch's promotion does.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab._src.precision import scopes
# The dtype predicates are the scopes' (the base of the engine); named here
# too, where every handler reads them.
from jmp_lab._src.precision.scopes import is_floating, is_half  # noqa: F401

F32 = np.dtype(jnp.float32)


class Role(enum.IntEnum):
  """Who decided a value's dtype (see the module doc); ordered, so that
  ``max`` of several roles is the one that decides an op."""

  STORED = 0
  HALF = 1
  WIDE = 2
  FP32 = 3


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def dtype_of(value: Any, var: Any = None) -> Optional[np.dtype]:
  """``value``'s dtype (a literal's: its written one; None: not an array
  or an extended dtype such as a PRNG key)."""
  dtype = getattr(value, "dtype", None)
  if dtype is None and var is not None:
    dtype = var.aval.dtype
  try:
    return np.dtype(dtype) if dtype is not None else None
  except TypeError:
    return None


def written_dtype(var: Any) -> Optional[np.dtype]:
  """The floating dtype the code wrote for ``var``, or None."""
  dtype = getattr(var.aval, "dtype", None)
  try:
    return np.dtype(dtype) if is_floating(dtype) else None
  except TypeError:
    return None


def cast(value: Any, dtype: Any) -> Any:
  """``value`` in ``dtype`` if it is a floating value in another dtype."""
  dtype = np.dtype(dtype)
  current = dtype_of(value)
  if current is None or current == dtype or not is_floating(current):
    return value
  if isinstance(value, (np.ndarray, np.generic, float, int)):
    return np.asarray(value, dtype)
  return jax.lax.convert_element_type(value, dtype)


def restore(value: Any, var: Any) -> Any:
  """``value`` in the dtype (and weak type) the code wrote for ``var``."""
  written = written_dtype(var)
  if written is None or dtype_of(value) in (None, written):
    return value
  if isinstance(value, (np.ndarray, np.generic, float, int)):
    return np.asarray(value, written)
  return jax.lax.convert_element_type_p.bind(
      value, new_dtype=written,
      weak_type=bool(getattr(var.aval, "weak_type", False)), sharding=None)


def role_of_result(value: Any, inputs: Sequence[Role]) -> Role:
  """The role of an op's result computed as written: STORED when it was
  computed from stored values alone, else by its dtype."""
  dtype = dtype_of(value)
  if not is_floating(dtype) or all(r == Role.STORED for r in inputs):
    return Role.STORED
  return Role.HALF if is_half(dtype) else Role.WIDE


def roles_by_dtype(values: Sequence[Any]) -> list[Role]:
  """Roles of values that cross a boundary in the dtypes the code wrote:
  half ones are half, other floating ones fp32."""
  return [role_of_result(v, [Role.HALF]) for v in values]


def aval(x: Any) -> Any:
  # A tracer's own type: it may carry varying manual axes (shard_map).
  return jax.typeof(x)


# ---- equations ---------------------------------------------------------------

Handler = Callable[["Op"], tuple[list, list]]


# Ops that lay a value out again without computing on it.
_LAYOUT_OPS = frozenset({"transpose", "reshape", "convert_element_type",
                         "squeeze", "expand_dims", "copy"})
# Ops that take a part of their first operand: one expert's or one layer's
# matrix of a stacked weight (``w[e]``, ``jnp.take(w, e, axis=0)``, ``w[i]``
# in a ``fori_loop``; ``w[expert_of_each_token]`` too, as autocast takes
# it: a batch of one matrix per token).
_SLICING_OPS = frozenset({"slice", "dynamic_slice", "gather"})
# Ops that hand each operand back as it was, as its result of the same
# position: a sharding constraint (MaxText's ``nn.with_logical_constraint``
# on its kernels), ``checkpoint_name``, ``optimization_barrier``.
_PASSING_OPS = frozenset({"sharding_constraint", "name",
                          "optimization_barrier"})


def _keeps_matrices(name: str, operand: Any, out: Any) -> bool:
  """Whether an indexed part of a weight is whole matrices of it (an
  expert's ``w[e]``, a matrix per token): a gather or dynamic slice of
  stacked weights that keeps their last two axes. Rows looked up by token
  ids (``table[ids]``) are activations, not a weight."""
  if name not in ("gather", "dynamic_slice"):
    return True
  return (np.ndim(operand) >= 3 and np.ndim(out) >= 2
          and np.shape(out)[-2:] == np.shape(operand)[-2:])


@dataclasses.dataclass(frozen=True)
class Context:
  """What every equation of one interpretation shares.

  Attributes:
    rules: the op rules.
    base: the named scopes above the jaxpr being evaluated.
    transposable: False inside a ``custom_vjp`` (never transposed).
    report: ``{(primitive, path): why}`` of what ran as written.
    evaluate: the interpreter's ``(jaxpr, consts, args, roles, context) ->
      (outs, roles)``, for the handlers of sub-jaxprs.
    inputs: the input variables of the jaxpr being evaluated (not its
      constants): what the code was handed, such as a weight, as opposed
      to what it built (a mask, a one-hot matrix, a constant table). In a
      sub-jaxpr (a scan's body, a jitted helper) they are what its caller
      passed, which can be a matrix the caller built.
    weights: ``{id(value): value}`` of the params the front end read and
      their layouts (:meth:`mark_weights`), shared by the whole
      interpretation.
  """

  rules: Any
  base: tuple[str, ...]
  transposable: bool
  report: dict
  evaluate: Callable
  inputs: frozenset = frozenset()
  weights: dict = dataclasses.field(default_factory=dict, compare=False)

  def is_weight(self, value: Any) -> bool:
    """Whether ``value`` is a param as a layer read it (see
    :meth:`mark_weights`)."""
    return id(value) in self.weights

  def mark_weights(self, op: "Op", outs: Sequence[Any]) -> None:
    """Takes ``op``'s results for weights when it reads a param (a front
    end's cast under :func:`~.scopes.param_read_scope`), lays one out
    again (a transpose, a reshape, a cast of a weight), as Hugging Face's
    ``FlaxConv1D`` multiplies by ``kernel.transpose()``, or takes a part of
    one (an expert's matrix of stacked weights, ``w[e]``). Keyed by the
    values themselves, which the dict keeps alive: a jitted helper
    (``jnp.einsum``) receives the same values."""
    if ((op.name == "convert_element_type" and scopes.is_param_read(op.path))
        or (op.name in _LAYOUT_OPS | _SLICING_OPS and op.invals
            and self.is_weight(op.invals[0])
            and _keeps_matrices(op.name, op.invals[0], outs[0]))):
      self.weights.update((id(o), o) for o in outs)
    elif op.name in _PASSING_OPS:
      self.mark_slices(op.invals, outs)

  def mark_slices(self, stacked: Sequence[Any], slices: Sequence[Any]
                  ) -> None:
    """Takes each of ``slices`` for a weight where its ``stacked`` value is
    one: a ``lax.scan``'s ``xs`` (a layer's matrices scanned over), or the
    operands of an op that hands them back (``_PASSING_OPS``)."""
    self.weights.update((id(part), part) for whole, part in zip(stacked,
                                                                slices)
                        if self.is_weight(whole))

  def inside(self, path: tuple[str, ...], **changes) -> "Context":
    return dataclasses.replace(self, base=path, **changes)

  def unreached(self, primitive: str, path: tuple[str, ...], why: str):
    self.report.setdefault((primitive, scopes.user_path(path) or "<top>"),
                           why)


@dataclasses.dataclass(frozen=True)
class Op:
  """One equation being evaluated."""

  eqn: Any
  invals: list
  roles: list
  path: tuple[str, ...]
  region: scopes.Region
  pulled: bool      # it only feeds fp32 ops: it runs in fp32 too
  context: Context

  @property
  def name(self) -> str:
    return self.eqn.primitive.name


def bind(eqn, args: Sequence[Any], params: Optional[dict] = None) -> list:
  """``eqn``'s primitive applied to ``args`` (with ``params``)."""
  params = eqn.params if params is None else params
  # A dict on every supported jax (jax before 0.10 gave (subfuns, params)).
  out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
  return list(out) if eqn.primitive.multiple_results else [out]


def as_written(op: "Op") -> tuple[list, list]:
  """The op in the dtypes the code wrote."""
  args = [restore(x, v) for x, v in zip(op.invals, op.eqn.invars)]
  outs = bind(op.eqn, args)
  inputs = [r for r, v in zip(op.roles, op.eqn.invars) if written_dtype(v)]
  return outs, [role_of_result(o, inputs) for o in outs]
