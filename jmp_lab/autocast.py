"""Op-level mixed precision for any JAX function: ``torch.autocast``'s rules.

``autocast(fn, policy)`` returns a function that computes what ``fn``
computes, with each op's precision decided by a rule, as
``torch.autocast`` decides it. Under a half compute dtype (``bfloat16`` or
``float16``):

* **Matmuls in half precision.** Every ``dot_general`` and convolution runs
  with both operands in the compute dtype, whatever dtype they arrive in.
  This covers ``jnp.matmul``, ``jnp.einsum``, ``x @ w``, Flax's and
  Equinox's layers, and code that casts its operands to fp32 first (as a
  Flax layer with ``dtype=jnp.float32`` does). The result is in the compute
  dtype. Tensor cores accumulate it in fp32; XLA:CPU does too. Its gradients
  are half-precision GEMMs too. Integer and fp8 matmuls are left alone.
* **Sensitive ops in fp32** (:data:`FP32_OPS`: exp, log, log1p, expm1,
  pow, rsqrt, the sum and product reductions, cumsum and cumlogsumexp...). Half inputs are cast to fp32 first. This covers softmax
  and its sum, logsumexp, the mean and variance reductions of norms written
  inline, and losses built from log-softmax. An fp32 result stays fp32 until
  a matmul (which casts it to the compute dtype), a control-flow boundary or
  the function's output. A cast back to half precision in between is
  deferred: ``jax.nn.softmax`` of bf16 logits equals
  ``jax.nn.softmax(logits.astype(jnp.float32))`` bit for bit. jnp's own
  reductions cast back to half internally, and ``jnp.mean`` is no
  exception.
* **Everything else follows its inputs**: an op whose inputs arrive in
  another dtype than the code wrote runs in the widest of them.
  ``x @ w + b`` with an fp32 ``b`` adds in fp32, as torch does.
* Floating outputs of ``fn`` are cast to the policy's ``output_dtype``.

Params keep their stored dtype: ``autocast`` changes the computation, not the
arguments. It composes with :func:`jmp_lab.mixed_precision`,
:func:`jmp_lab.fused_adamw` and :func:`jmp_lab.scaled_value_and_grad`
unchanged, and with ``jit``, ``grad``, ``vmap``, ``lax.scan`` and ``nn.scan``,
``jax.checkpoint`` and ``nn.remat``, ``custom_jvp`` and ``custom_vjp``
functions, ``shard_map``, and jmp_lab's fp8 and ``reduce`` matmuls.

**Overrides.** ``fp32_ops`` names more primitives to run in fp32 (or replaces
the set). ``exclude`` holds regular expressions over the path of named scopes
(``jax.named_scope``). Flax linen puts module paths there
(``"Model/head"``). An op under an excluded scope runs as written. Inside
``fn``, ``with jmp_lab.autocast.scope(jnp.float32):`` keeps a region as
written, and ``scope(jnp.bfloat16)`` puts one back under the rules. The
innermost scope wins.

**The mechanism, and why.** ``fn`` is traced to a jaxpr, and the jaxpr is
evaluated again op by op with the rules applied. This is a jaxpr
interpreter, like ``jax.core.eval_jaxpr`` with rules. It was chosen over
intercepting the ``lax`` functions, as qwix does for quantization, because
re-interpreting the jaxpr reaches every op. That includes the
``dot_general`` that ``jnp.einsum`` and ``jnp.matmul`` emit internally,
matmuls inside jitted helpers whose traces jax has cached, and code that
calls ``lax`` directly. An interceptor sees only the calls that go through
the function it patched. Sub-jaxprs are rewritten in place with the same
input and output types:

* the bodies of ``scan``, ``while``, ``cond`` and ``checkpoint``, and the
  primal, the JVP rule and the forward and backward rules of ``custom_jvp``
  and ``custom_vjp`` functions, whose custom derivatives are kept;
* ``shard_map`` bodies, rebuilt with ``jax.shard_map``;
* ``jit`` calls inside ``fn``, inlined.

Pallas kernels choose their own precision and are left alone. Values cross
these boundaries in the dtypes the code wrote.

Under ``jax.grad`` the backward pass is jax's transpose of the rewritten
forward pass, so its GEMMs are half precision too. Inside a ``custom_vjp``,
which is never transposed, a matmul keeps its accumulation dtype
(``preferred_element_type``). jmp_lab's reduce-dtype weight gradients
therefore stay fp32 GEMMs over half operands.

Cost: ``fn`` is traced twice (once to a jaxpr, once under the rules), at
trace time. Call it under ``jax.jit`` as any JAX training code is. Called
eagerly, every op is dispatched one by one.

This module reads some of jax's internals, as ``jax.core.eval_jaxpr``
itself does: jaxpr equations, their bind parameters, name stacks, and the
rules of ``custom_jvp`` and ``custom_vjp`` calls. A sub-jaxpr it cannot
rewrite runs as written, and a warning names it.

Example::

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> def mlp(params, x):                      # plain JAX, fp32 params
  ...   h = jax.nn.relu(x @ params["w1"] + params["b1"])
  ...   return jax.nn.log_softmax(h @ params["w2"])
  >>> params = {"w1": jnp.ones((8, 16)), "b1": jnp.zeros(16),
  ...           "w2": jnp.ones((16, 4))}
  >>> fast = jmp_lab.autocast(mlp, "mixed_bfloat16")
  >>> fast(params, jnp.ones((2, 8))).dtype                     # output_dtype
  dtype('float32')
  >>> report = jmp_lab.diagnostics.audit_step(fast, params, jnp.ones((2, 8)))
  >>> report.half_flop_share
  1.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_lab import _gemm
from jmp_lab._nesting import Nesting
from jmp_lab.policy import Policy, get_policy

# jax internals the interpreter needs (see the module doc); each use is
# guarded so that a jax without one degrades to "run as written".
from jax._src import api_util as _api_util  # noqa: E402
from jax._src import linear_util as _lu  # noqa: E402
from jax._src import source_info_util as _source_info  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402

PolicySpec = Union[Policy, str]

# The ops the rules act on, by primitive name.
MATMUL_OPS = frozenset({"dot_general", "conv_general_dilated"})

#: Primitives that run in fp32 from half inputs (torch.autocast's fp32 list,
#: as JAX primitives): exponentials and logarithms, ``pow``, rsqrt, the
#: inverse trigonometric and hyperbolic functions torch lists, and the sum,
#: product and cumulative reductions. Softmax, logsumexp, norms written
#: inline and losses are built from these. ``x ** 2`` and ``x ** 3``
#: (``integer_pow``, ``square``) are not: jax.nn.gelu computes ``x ** 3``,
#: and torch runs GELU in its input's dtype.
FP32_OPS = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "pow", "rsqrt", "tan", "asin", "acos", "sinh", "cosh", "erf_inv",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
})

# Ops that accept any floating dtype and run in the widest one their inputs
# arrive in ("everything else follows its inputs"). An op in neither list
# gets its inputs back in the dtypes the code wrote.
_FOLLOW_OPS = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "sign", "abs",
    "floor", "ceil", "round", "nextafter", "sqrt", "cbrt", "tanh", "logistic",
    "square", "integer_pow",
    "sin", "cos", "atan", "atan2", "asinh", "acosh", "atanh", "erf", "erfc",
    "lgamma", "digamma", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "clamp", "stop_gradient", "copy", "copy_p", "reduce_max",
    "reduce_min", "argmax", "argmin", "cummax", "cummin", "broadcast_in_dim",
    "reshape", "transpose", "squeeze", "expand_dims", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "sharding_constraint", "reduce_precision", "sort", "split",
    "optimization_barrier",
} | FP32_OPS)

# jit-like calls: inlined, so that values cross them in the dtypes the rules
# gave (jnp wraps many of its helpers, such as jnp.where, in a jit).
_INLINED_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Higher-order primitives left alone: a Pallas kernel chooses its precision.
_OPAQUE = frozenset({"pallas_call", "custom_partitioning", "run_state"})

_SCOPE_PREFIX = "jmp_lab:"
_CAST_SCOPE = _SCOPE_PREFIX + "cast"
_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_F32 = np.dtype(jnp.float32)


# ---------------------------------------------------------------------------
# Scopes: which rules apply to a region of a traced function.
# ---------------------------------------------------------------------------


def scope(dtype: Any) -> contextlib.AbstractContextManager:
  """Ops traced inside run with ``dtype`` as the compute dtype.

  ``scope(jnp.float32)`` keeps a region of an autocast function as written;
  ``scope(jnp.bfloat16)`` puts a region under the half rules. The innermost
  scope wins. It is a ``jax.named_scope``, so it also names the region in
  profiles. :func:`jmp_lab.linen.with_policy` and
  :func:`jmp_lab.nnx.with_policy` mark every module call this way.

  Example::

    >>> import jax, jax.numpy as jnp, jmp_lab
    >>> def f(x, w):
    ...   with jmp_lab.autocast.scope(jnp.float32):   # a head kept in fp32
    ...     return x @ w
    >>> audit = jmp_lab.diagnostics.audit_step(
    ...     jmp_lab.autocast(f, "mixed_bfloat16"), jnp.ones((8, 8)), jnp.ones((8, 8)))
    >>> audit.half_flop_share
    0.0
  """
  from jmp_lab.policy import _canonicalize_dtype  # the one dtype parser
  return jax.named_scope(_SCOPE_PREFIX
                         + _canonicalize_dtype(dtype, what="scope dtype").name)


def current_compute_dtype() -> Optional[np.dtype]:
  """The compute dtype of the innermost :func:`scope` around the code being
  traced (a policed module's call), or None outside one.

  Code that must pick a half dtype itself, such as a fused attention kernel
  inside a layer that was given ``dtype=jnp.float32``, asks this.
  """
  for name in reversed(_scope_names(_source_info.current_name_stack())):
    if name.startswith(_SCOPE_PREFIX) and name != _CAST_SCOPE:
      return np.dtype(name[len(_SCOPE_PREFIX):])
  return None


def policy_cast_scope() -> contextlib.AbstractContextManager:
  """Casts traced inside are policy decisions and are always kept, even of
  an fp32 value (a cast a front end makes at a module boundary)."""
  return jax.named_scope(_CAST_SCOPE)


@dataclasses.dataclass(frozen=True)
class Rules:
  """What :func:`autocast` does; see the module doc.

  Attributes:
    compute_dtype: the compute dtype outside any :func:`scope`.
    fp32_ops: primitive names that run in fp32 from half inputs.
    exclude: compiled regular expressions over named-scope paths; an op
      under a matching path runs as written.
  """

  compute_dtype: np.dtype
  fp32_ops: frozenset = FP32_OPS
  exclude: tuple = ()

  def compute_for(self, path: tuple[str, ...]) -> Optional[np.dtype]:
    """The half dtype the rules use for an op at ``path``, or None (the op
    runs as written)."""
    if self.exclude:
      joined = "/".join(n for n in path if not n.startswith(_SCOPE_PREFIX))
      if any(pattern.search(joined) for pattern in self.exclude):
        return None
    dtype = self.compute_dtype
    for name in reversed(path):
      if name.startswith(_SCOPE_PREFIX) and name != _CAST_SCOPE:
        dtype = np.dtype(name[len(_SCOPE_PREFIX):])
        break
    return dtype if dtype in _HALF else None


def make_rules(compute_dtype: Any, *, fp32_ops: Optional[Iterable[str]] = None,
               extra_fp32_ops: Iterable[str] = (),
               exclude: Union[str, Iterable[str], None] = None) -> Rules:
  """Checked :class:`Rules`; see :func:`autocast` for the arguments."""
  from jmp_lab.policy import _canonicalize_dtype
  compute_dtype = _canonicalize_dtype(compute_dtype, what="compute_dtype")
  ops = FP32_OPS if fp32_ops is None else _op_names(fp32_ops, "fp32_ops")
  ops = ops | _op_names(extra_fp32_ops, "extra_fp32_ops")
  if isinstance(exclude, str):
    exclude = (exclude,)
  patterns = []
  for pattern in exclude or ():
    if not isinstance(pattern, str):
      raise TypeError(f"exclude must hold regular expressions (str), got "
                      f"{type(pattern).__name__} {pattern!r}")
    try:
      patterns.append(re.compile(pattern))
    except re.error as e:
      raise ValueError(f"invalid exclude pattern {pattern!r}: {e}") from None
  return Rules(compute_dtype, frozenset(ops), tuple(patterns))


def _op_names(names: Iterable[str], what: str) -> frozenset:
  if isinstance(names, str):
    names = (names,)
  names = tuple(names)
  unknown = [n for n in names if not isinstance(n, str)
             or n not in _FOLLOW_OPS | MATMUL_OPS]
  if unknown:
    raise ValueError(
        f"{what} has unknown primitive names {unknown!r}; accepted: "
        f"{', '.join(sorted(_FOLLOW_OPS - {'copy_p'}))}")
  return frozenset(names)


# ---------------------------------------------------------------------------
# The public transformation.
# ---------------------------------------------------------------------------


def autocast(fn: Callable[..., Any], policy: PolicySpec, *,
             fp32_ops: Optional[Iterable[str]] = None,
             extra_fp32_ops: Iterable[str] = (),
             exclude: Union[str, Iterable[str], None] = None
             ) -> Callable[..., Any]:
  """``fn`` with torch.autocast's per-op precision rules (see the module doc).

  Args:
    fn: any JAX function (plain JAX, Equinox, a Flax ``apply``). Its array
      arguments are traced; other arguments (Python scalars, functions,
      Equinox's static fields) are passed as they are.
    policy: a :class:`~jmp_lab.Policy` or its spec; its ``compute_dtype`` is
      the matmuls' dtype and its ``output_dtype`` the outputs'. A full
      precision compute dtype leaves ``fn`` as written.
    fp32_ops: the primitives to run in fp32 (default :data:`FP32_OPS`).
    extra_fp32_ops: primitives to add to them (e.g. ``"tanh"``).
    exclude: regular expressions over named-scope paths whose ops run as
      written (e.g. ``"head"``; linen module paths are named scopes).

  Returns:
    A function with ``fn``'s signature. Its ``policy`` and ``rules``
    attributes say what it does.

  Raises:
    TypeError: if ``fn`` is not callable or an ``exclude`` entry is not a
      string.
    ValueError: for a bad policy spec, a policy with fp8 matmuls
      (``matmul=``: autocast has none), an unknown primitive name or an
      invalid regular expression.

  Example::

    >>> import jax, jax.numpy as jnp, jmp_lab
    >>> def attention(q, k, v):        # a custom attention, fp32 as written
    ...   weights = jax.nn.softmax(q @ k.T / 8.0)
    ...   return weights @ v
    >>> q = k = v = jnp.ones((16, 64))
    >>> jaxpr = jax.make_jaxpr(jmp_lab.autocast(attention, "mixed_bfloat16"))(q, k, v)
    >>> sorted({str(e.invars[0].aval.dtype) for e in jaxpr.eqns
    ...         if e.primitive.name in ("dot_general", "exp")})
    ['bfloat16', 'float32']
  """
  if not callable(fn):
    raise TypeError(f"autocast needs a callable fn, got {type(fn).__name__} "
                    f"{fn!r}")
  policy = get_policy(policy)
  if policy.matmul is not None:
    # An fp8 GEMM needs to know which operand is a layer's weight (and,
    # delayed, where its scaling state lives): an op-level rule does not.
    raise ValueError(
        f"autocast has no fp8 matmuls: policy {str(policy)!r} asks for "
        f"matmul={policy.matmul}, which would be silently left out. Use "
        f"jmp_lab.linen.with_policy or jmp_lab.nnx.with_policy for Flax "
        f"models, or call jmp_lab.fp8.dot_general / jmp_lab.fp8.einsum in "
        f"your own layers (they compose with autocast), and give autocast "
        f"the policy without matmul=")
  rules = make_rules(policy.compute_dtype, fp32_ops=fp32_ops,
                     extra_fp32_ops=extra_fp32_ops, exclude=exclude)
  wrapped = apply_rules(fn, rules, output_dtype=policy.output_dtype)
  wrapped.policy = policy
  return wrapped


def apply_rules(fn: Callable[..., Any], rules: Rules, *,
                output_dtype: Any = None) -> Callable[..., Any]:
  """:func:`autocast` with given :class:`Rules`; floating outputs are cast to
  ``output_dtype`` (None: left as the rules made them). The front ends
  (:mod:`jmp_lab.linen`, :mod:`jmp_lab.nnx`) use this."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    outputs = {}

    def flat_fn(*values):
      full = list(leaves)
      for i, value in zip(dynamic, values):
        full[i] = value
      call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
      with _TRACING.enter():
        out = fn(*call_args, **call_kwargs)
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      outputs["tree"] = out_tree
      outputs["leaves"] = out_leaves
      return [x for x in out_leaves if _is_array(x)]

    values = [leaves[i] for i in dynamic]
    jaxpr, consts = _trace(flat_fn, [_aval(x) for x in values], None)
    context = _Context(rules, _scope_names(_source_info.current_name_stack()),
                       transposable=True, report=_Report())
    results, _ = _eval_jaxpr(jaxpr, consts, values, context)
    # An output the trace folded to a literal comes back as an array.
    results = [x if _is_array(x) else jnp.asarray(x, v.aval.dtype)
               for x, v in zip(results, jaxpr.outvars)]
    context.report.warn()
    if output_dtype is not None:
      results = [_cast(x, output_dtype) if _is_floating(_dtype_of(x)) else x
                 for x in results]
    results = iter(results)
    out_leaves = [next(results) if _is_array(x) else x
                  for x in outputs["leaves"]]
    return jax.tree_util.tree_unflatten(outputs["tree"], out_leaves)

  wrapped.rules = rules
  return wrapped


class PrecisionWarning(UserWarning):
  """A policy asks for half precision where the computation does not run in
  it (see :func:`warn_unless_half`)."""


@dataclasses.dataclass
class MatmulCount:
  """Matmuls the rules ran (see :func:`recording`): ``half`` with half (or
  fp8) operands, ``full`` left with a wider floating operand."""

  half: int = 0
  full: int = 0


@contextlib.contextmanager
def recording():
  """Counts the matmuls the rules run while the block traces.

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> from jmp_lab.autocast import recording
  >>> with recording() as count:
  ...   _ = jmp_lab.autocast(jnp.matmul, "mixed_bfloat16")(jnp.ones((2, 2)),
  ...                                                      jnp.ones((2, 2)))
  >>> count
  MatmulCount(half=1, full=0)
  """
  count = MatmulCount()
  stack = _local.__dict__.setdefault("recorders", [])
  stack.append(count)
  try:
    yield count
  finally:
    stack.remove(count)


def _note_matmul(operand_dtypes) -> None:
  floating = [d for d in operand_dtypes if _is_floating(d)]
  if len(floating) < 2:
    return
  half = all(d.itemsize <= 2 for d in floating)
  for count in getattr(_local, "recorders", ()):
    if half:
      count.half += 1
    else:
      count.full += 1


def warn_unless_half(policy: Policy, count: MatmulCount,
                     trace: Callable[[], Any], where: str) -> None:
  """Warns (:class:`PrecisionWarning`) when ``policy`` computes in half
  precision but no matmul of the model does.

  ``count`` holds what the rules ran while the loss was traced. When they
  did not run at all (the model is not wrapped by a front end or
  :func:`autocast`), ``trace()`` gives the loss's jaxpr, whose matmuls are
  read instead: a model that casts by hand is not warned about.
  """
  if policy.compute_dtype not in _HALF:
    return
  if count.half or count.full:
    if not count.half:
      warnings.warn(
          f"{where}: the policy ({policy}) computes in "
          f"{policy.compute_dtype.name}, but every matmul of the model runs "
          f"in fp32: the policy's overrides (keep_layer_dtypes=True, or "
          f"class/path overrides) keep them there", PrecisionWarning,
          stacklevel=4)
    return
  from jmp_lab.diagnostics.audit import matmul_records  # no import cycle
  records = matmul_records(trace())
  if records and not any(r.half for r in records):
    warnings.warn(
        f"{where}: the policy ({policy}) computes in "
        f"{policy.compute_dtype.name}, but every matmul of the loss runs in "
        f"fp32: wrap the model with jmp_lab.linen.with_policy, "
        f"jmp_lab.nnx.with_policy or jmp_lab.autocast", PrecisionWarning,
        stacklevel=4)


# Per thread: the recorders collecting what the rules did.
_local = threading.local()
# Whether user code is being traced by apply_rules on this thread (the NNX
# front end asks, to run a model's own call only once under the rules).
_TRACING = Nesting()


def is_tracing() -> bool:
  """Whether the calling code is being traced under the rules."""
  return _TRACING.active


# ---------------------------------------------------------------------------
# The interpreter.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Report:
  """What the rules could not reach, warned about once per place."""

  unreached: dict = dataclasses.field(default_factory=dict)

  def add(self, primitive: str, path: tuple[str, ...], why: str) -> None:
    path = "/".join(n for n in path if not n.startswith(_SCOPE_PREFIX))
    self.unreached.setdefault((primitive, path or "<top>"), why)

  def warn(self) -> None:
    for (primitive, path), why in self.unreached.items():
      if (primitive, path) in _WARNED:
        continue
      _WARNED.add((primitive, path))
      warnings.warn(
          f"jmp_lab.autocast: the {primitive} at {path!r} runs as written "
          f"({why})", stacklevel=3)


_WARNED: set = set()


@dataclasses.dataclass(frozen=True)
class _Context:
  rules: Rules
  base: tuple[str, ...]       # named scopes above the jaxpr being evaluated
  transposable: bool          # False inside a custom_vjp (never transposed)
  report: _Report

  def inside(self, path: tuple[str, ...], **changes) -> "_Context":
    return dataclasses.replace(self, base=path, **changes)


def _eval_jaxpr(jaxpr, consts: Sequence[Any], args: Sequence[Any],
                context: _Context, wide_args: Sequence[bool] = ()
                ) -> tuple[list[Any], list[bool]]:
  """Evaluates ``jaxpr`` under the rules: its output values (in the dtypes
  the rules gave them) and which of them are fp32-by-rule ("wide")."""
  env: dict = {}
  wide: set = set()
  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for i, (var, value) in enumerate(zip(jaxpr.invars, args)):
    env[var] = value
    if i < len(wide_args) and wide_args[i]:
      wide.add(var)

  def read(atom):
    return atom.val if isinstance(atom, jex_core.Literal) else env[atom]

  pulled = _pulled_into_fp32(jaxpr, context.rules.fp32_ops)
  for index, eqn in enumerate(jaxpr.eqns):
    path = context.base + _scope_names(eqn.source_info.name_stack)
    invals = [read(v) for v in eqn.invars]
    in_wide = [not isinstance(v, jex_core.Literal) and v in wide
               for v in eqn.invars]
    name_stack = (_source_info.current_name_stack()
                  + eqn.source_info.name_stack)
    with _source_info.user_context(eqn.source_info.traceback,
                                   name_stack=name_stack), eqn.ctx.manager:
      outs, out_wide = _eval_eqn(eqn, invals, in_wide, path, context,
                                 index in pulled)
    for var, value, is_wide in zip(eqn.outvars, outs, out_wide):
      env[var] = value
      if is_wide:
        wide.add(var)
  return ([read(v) for v in jaxpr.outvars],
          [not isinstance(v, jex_core.Literal) and v in wide
           for v in jaxpr.outvars])


def _pulled_into_fp32(jaxpr, fp32_ops: frozenset) -> set[int]:
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
    if name in fp32_ops or not (name in _FOLLOW_OPS
                                or name == "convert_element_type"):
      continue
    floating = [v for v in eqn.outvars
                if _is_floating(getattr(v.aval, "dtype", None))]
    if floating and all(feeds_fp32(v) for v in floating):
      pulled.add(i)
  return pulled


def _eval_eqn(eqn, invals, in_wide, path, context, pulled=False):
  name = eqn.primitive.name
  compute = context.rules.compute_for(path)
  if name in _INLINED_CALLS and _inlinable(eqn):
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    jaxpr, consts = _open(inner)
    return _eval_jaxpr(jaxpr, consts, invals, context.inside(path), in_wide)
  if name == "custom_jvp_call":
    return _rewritten(eqn, invals, path, context, _custom_jvp_params)
  if name == "custom_vjp_call":
    return _rewritten(eqn, invals, path, context, _custom_vjp_params)
  if name == "shard_map":
    return _shard_map(eqn, invals, path, context)
  if name not in _OPAQUE and _has_subjaxprs(eqn):
    return _rewritten(eqn, invals, path, context, _subjaxpr_params)
  if name in MATMUL_OPS and compute is None:
    _note_matmul([np.dtype(v.aval.dtype) for v in eqn.invars[:2]])
  if compute is None or name in _OPAQUE:
    return _as_written(eqn, invals)
  if name in MATMUL_OPS:
    return _matmul(eqn, invals, compute, context)
  if pulled:
    return _in_fp32(eqn, invals, in_wide)
  if name == "convert_element_type":
    return _convert(eqn, invals, in_wide, path)
  if name in context.rules.fp32_ops:
    return _fp32_op(eqn, invals, in_wide)
  if name in _FOLLOW_OPS:
    return _follow(eqn, invals, in_wide)
  return _as_written(eqn, invals)


# ---- the rules ------------------------------------------------------------


def _matmul(eqn, invals, compute, context):
  written = [np.dtype(v.aval.dtype) for v in eqn.invars[:2]]
  actual = [_dtype_of(x, v) for x, v in zip(invals, eqn.invars)]
  if not all(_is_floating(d) and d.itemsize > 1 for d in actual[:2]):
    _note_matmul(written)
    return _as_written(eqn, invals)  # integer or fp8: not ours to change
  _note_matmul([compute, compute])
  operands = [_cast(x, compute) for x in invals[:2]]
  params = dict(eqn.params)
  if (written != [compute, compute] and context.transposable
      and "preferred_element_type" in params):
    # The result in the compute dtype (the GEMM accumulates in fp32): an
    # fp32 result would make jax's transpose a GEMM of an fp32 cotangent by
    # a half operand, which runs in fp32.
    params["preferred_element_type"] = compute
  result = params.get("preferred_element_type")
  if result is None or np.dtype(result).itemsize <= compute.itemsize:
    return _bind(eqn, operands + list(invals[2:]), params), [False]
  # Half operands, a wider result (a backward rule's fp32 accumulation):
  # XLA:CPU cannot run every such GEMM (jmp_lab._gemm).
  return [_gemm.accumulated(
      lambda *ops: _bind(eqn, list(ops) + list(invals[2:]), params)[0],
      operands, result)], [False]


def _convert(eqn, invals, in_wide, path):
  new_dtype = np.dtype(eqn.params["new_dtype"])
  if (in_wide[0] and new_dtype in _HALF and _CAST_SCOPE not in path):
    return [invals[0]], [True]  # deferred: an fp32 result stays fp32
  out = _bind(eqn, invals)
  return out, [in_wide[0] and _is_floating(new_dtype)]


def _fp32_op(eqn, invals, in_wide):
  floating = [_is_floating(np.dtype(v.aval.dtype)) for v in eqn.invars]
  if not any(f and _dtype_of(x, v) in _HALF
             for f, x, v in zip(floating, invals, eqn.invars)):
    return _follow(eqn, invals, in_wide)
  upcast = [_cast(x, _F32) if f and _dtype_of(x, v) in _HALF else x
            for f, x, v in zip(floating, invals, eqn.invars)]
  outs = _bind(eqn, upcast)
  return outs, [_is_floating(_dtype_of(o)) for o in outs]


def _in_fp32(eqn, invals, in_wide):
  """An op pulled into fp32 (:func:`_pulled_into_fp32`): half inputs are
  cast to fp32; a cast to half precision keeps fp32."""
  if eqn.primitive.name == "convert_element_type":
    target = jnp.promote_types(_F32, eqn.params["new_dtype"])
    return [_cast(invals[0], target)], [True]
  floating = [_is_floating(np.dtype(v.aval.dtype)) for v in eqn.invars]
  upcast = [_cast(x, _F32) if f and _dtype_of(x, v) in _HALF else x
            for f, x, v in zip(floating, invals, eqn.invars)]
  try:
    outs = _bind(eqn, upcast)
  except (TypeError, ValueError):
    return _follow(eqn, invals, in_wide)
  return outs, [_is_floating(_dtype_of(o)) for o in outs]


def _follow(eqn, invals, in_wide):
  """Inputs written in one dtype run in the widest dtype they arrive in."""
  groups: dict = {}
  for i, var in enumerate(eqn.invars):
    written = np.dtype(var.aval.dtype)
    if _is_floating(written):
      groups.setdefault(written, []).append(i)
  args = list(invals)
  changed = False
  for members in groups.values():
    target = functools.reduce(
        jnp.promote_types, [_dtype_of(invals[i], eqn.invars[i])
                            for i in members])
    for i in members:
      if _dtype_of(invals[i], eqn.invars[i]) != target:
        args[i] = _cast(invals[i], target)
        changed = True
  is_wide = any(in_wide)
  if not changed and not any(
      _dtype_of(x, v) != np.dtype(v.aval.dtype)
      for x, v in zip(invals, eqn.invars)):
    outs = _bind(eqn, args)
  else:
    try:
      outs = _bind(eqn, args)
    except (TypeError, ValueError):  # the op insists on its written dtypes
      return _as_written(eqn, invals)
  return outs, [is_wide and _is_floating(_dtype_of(o)) for o in outs]


def _as_written(eqn, invals):
  args = [_restore(x, v) for x, v in zip(invals, eqn.invars)]
  outs = _bind(eqn, args)
  return outs, [False] * len(outs)


# ---- higher-order primitives ------------------------------------------------


def _rewritten(eqn, invals, path, context, make_params):
  """Binds ``eqn`` with its sub-jaxprs (or rules) rewritten under the rules;
  values cross it in the dtypes the code wrote."""
  args = [_restore(x, v) for x, v in zip(invals, eqn.invars)]
  try:
    params = make_params(eqn, context.inside(path))
  except _CannotRewrite as e:
    inside = sorted({"/".join(
        n for n in _scope_names(m.source_info.name_stack)
        if not n.startswith(_SCOPE_PREFIX)) for m in _matmuls_in(eqn.params)}
                    - {""})
    context.report.add(eqn.primitive.name, path, str(e) + (
        f"; its matmuls under {', '.join(map(repr, inside))} stay as written"
        if inside else ""))
    params = eqn.params
  outs = _bind(eqn, args, params)
  return outs, [False] * len(outs)


class _CannotRewrite(Exception):
  pass


def _matmuls_in(params) -> list:
  """The matmul equations inside an equation's sub-jaxprs (for warnings)."""
  found = []
  for value in params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if _is_jaxpr(sub):
        jaxpr, _ = _open(sub)
        for eqn in jaxpr.eqns:
          if eqn.primitive.name in MATMUL_OPS:
            found.append(eqn)
          found += _matmuls_in(eqn.params)
  return found


def _subjaxpr_params(eqn, context):
  """``scan``, ``while``, ``cond``, ``checkpoint``...: every sub-jaxpr
  rewritten, with the same input and output types."""
  params = {}
  for key, value in eqn.params.items():
    if _is_jaxpr(value):
      params[key] = _rewrite_jaxpr(value, context)
    elif isinstance(value, (tuple, list)) and value and all(
        _is_jaxpr(v) for v in value):
      params[key] = type(value)(_rewrite_jaxpr(v, context) for v in value)
    else:
      params[key] = value
  return params


def _custom_jvp_params(eqn, context):
  params = dict(eqn.params)
  try:
    call, jvp_fun = params["call_jaxpr"], params["jvp_jaxpr_fun"]
  except KeyError as e:
    raise _CannotRewrite(f"this jax's custom_jvp_call has no {e}") from None
  params["call_jaxpr"] = _rewrite_jaxpr(call, context)

  @_memoized
  def jvp_thunk(*zeros):
    jvp_jaxpr, jvp_consts, out_zeros = jvp_fun.call_wrapped(*zeros)
    return (*_rewrite_open(jvp_jaxpr, jvp_consts, context), out_zeros)

  params["jvp_jaxpr_fun"] = _lu.wrap_init(jvp_thunk,
                                          debug_info=jvp_fun.debug_info)
  return params


def _custom_vjp_params(eqn, context):
  # Inside a custom_vjp nothing is transposed: matmuls keep their
  # accumulation dtype (preferred_element_type).
  context = dataclasses.replace(context, transposable=False)
  params = dict(eqn.params)
  try:
    call, fwd, bwd = (params["call_jaxpr"], params["fwd_jaxpr_thunk"],
                      params["bwd"])
  except KeyError as e:
    raise _CannotRewrite(f"this jax's custom_vjp_call has no {e}") from None
  params["call_jaxpr"] = _rewrite_jaxpr(call, context)

  @_memoized
  def fwd_thunk(*zeros):
    return _rewrite_open(*fwd.call_wrapped(*zeros), context)

  def bwd_fun(*args):
    return _call_under_rules(bwd.call_wrapped, args, context)

  params["fwd_jaxpr_thunk"] = _lu.wrap_init(fwd_thunk,
                                            debug_info=fwd.debug_info)
  params["bwd"] = _lu.wrap_init(bwd_fun, debug_info=bwd.debug_info)
  return params


def _shard_map(eqn, invals, path, context):
  params = eqn.params
  body = params["jaxpr"]
  inner = context.inside(path)
  args = [_restore(x, v) for x, v in zip(invals, eqn.invars)]

  def per_shard(*shards):
    outs, _ = _eval_jaxpr(body, (), shards, inner)
    return tuple(_restore(x, v) for x, v in zip(outs, body.outvars))

  try:
    mapped = jax.shard_map(
        per_shard, mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]), check_vma=params["check_vma"],
        axis_names=set(params.get("newly_manual_axes",
                                  params.get("manual_axes", ()))))
  except (KeyError, TypeError) as e:
    context.report.add("shard_map", path, f"not rebuilt: {e}")
    return _as_written(eqn, invals)
  outs = list(mapped(*args))
  return outs, [False] * len(outs)


def _rewrite_jaxpr(closed, context):
  """A jaxpr (closed or open) with the same types, evaluated under the
  rules."""
  jaxpr, consts = _open(closed)
  new_jaxpr, new_consts = _rewrite_open(jaxpr, consts, context)
  if _is_closed(closed):
    return jex_core.ClosedJaxpr(new_jaxpr, new_consts)
  if new_consts:
    raise _CannotRewrite("its rewritten body closes over constants")
  return new_jaxpr


def _rewrite_open(jaxpr, consts, context):
  def body(*args):
    outs, _ = _eval_jaxpr(jaxpr, consts, args, context)
    return [_restore(x, v) for x, v in zip(outs, jaxpr.outvars)]

  return _trace(body, [v.aval for v in jaxpr.invars], jaxpr.debug_info)


def _call_under_rules(fun, args, context):
  """``fun(*args)`` (a custom_vjp's backward rule) under the rules."""
  if not all(_is_array(a) for a in args):
    return fun(*args)  # symbolic zeros: left as written
  layout = {}

  def traced(*values):
    outs = list(fun(*values))
    layout["outs"] = outs
    return [o for o in outs if _is_array(o)]

  jaxpr, consts = _trace(traced, [_aval(a) for a in args], None)
  results, _ = _eval_jaxpr(jaxpr, consts, args, context)
  results = iter(_restore(x, v) for x, v in zip(results, jaxpr.outvars))
  return [next(results) if _is_array(o) else o for o in layout["outs"]]


# ---- small helpers ----------------------------------------------------------


def _trace(fun, in_avals, debug_info):
  """``fun`` traced to an open jaxpr over ``in_avals`` (exact types: weak
  types and varying axes kept), and its constants."""
  if debug_info is None:
    debug_info = _api_util.debug_info("jmp_lab.autocast", fun, (), {})
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
      _lu.wrap_init(fun, debug_info=debug_info), list(in_avals))
  return jaxpr, consts


def _memoized(thunk):
  cache = {}

  def call(*key):
    if key not in cache:
      cache[key] = thunk(*key)
    return cache[key]

  return call


def _bind(eqn, args, params=None):
  params = eqn.params if params is None else params
  bind_params = eqn.primitive.get_bind_params(params)
  if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
    subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *args, **bind_params)
  else:
    out = eqn.primitive.bind(*args, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _inlinable(eqn) -> bool:
  """A jit call without shardings of its own: inlined."""
  for key in ("in_shardings", "out_shardings"):
    for sharding in eqn.params.get(key, ()):
      if type(sharding).__name__ not in ("UnspecifiedValue", "NoneType"):
        return False
  return True


def _is_jaxpr(value) -> bool:
  return hasattr(value, "eqns") or (
      hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"))


def _is_closed(value) -> bool:
  return hasattr(value, "jaxpr") and hasattr(value, "consts")


def _has_subjaxprs(eqn) -> bool:
  return any(_is_jaxpr(v) or (isinstance(v, (tuple, list))
                              and any(_is_jaxpr(x) for x in v))
             for v in eqn.params.values())


def _open(value):
  """``(jaxpr, consts)`` of a closed or open jaxpr."""
  if _is_closed(value):
    return value.jaxpr, list(value.consts)
  return value, list(getattr(value, "consts", ()))


def _scope_names(name_stack) -> tuple[str, ...]:
  stack = getattr(name_stack, "stack", None)
  if stack is None:
    return tuple(n for n in str(name_stack).split("/") if n)
  return tuple(s.name for s in stack if type(s).__name__ == "Scope")


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _aval(x):
  # A tracer's own type: it may carry varying manual axes (shard_map).
  return jax.typeof(x)


def _is_floating(dtype) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _dtype_of(value, var=None) -> Optional[np.dtype]:
  dtype = getattr(value, "dtype", None)
  if dtype is None and var is not None:
    dtype = var.aval.dtype  # a literal: its written dtype
  try:
    return np.dtype(dtype) if dtype is not None else None
  except TypeError:  # extended dtypes (PRNG keys)
    return None


def _cast(value, dtype):
  dtype = np.dtype(dtype)
  current = _dtype_of(value)
  if current is None or current == dtype or not _is_floating(current):
    return value
  if isinstance(value, (np.ndarray, np.generic, float, int)):
    return np.asarray(value, dtype)
  return jax.lax.convert_element_type(value, dtype)


def _restore(value, var):
  """``value`` in the dtype (and weak type) the code wrote for ``var``."""
  written = np.dtype(var.aval.dtype) if _is_floating(
      getattr(var.aval, "dtype", None)) else None
  if written is None or _dtype_of(value) in (None, written):
    return value
  if isinstance(value, (np.ndarray, np.generic, float, int)):
    return np.asarray(value, written)
  return jax.lax.convert_element_type_p.bind(
      value, new_dtype=written, weak_type=bool(getattr(var.aval, "weak_type",
                                                       False)), sharding=None)


# ``jmp_lab.autocast`` is this module's function; its helpers ride on it.
autocast.scope = scope
autocast.FP32_OPS = FP32_OPS

__all__ = ["FP32_OPS", "MATMUL_OPS", "MatmulCount", "PrecisionWarning",
           "Rules", "apply_rules", "autocast", "current_compute_dtype",
           "is_tracing", "make_rules",
           "policy_cast_scope", "recording", "scope", "warn_unless_half"]
