"""The linen front end: the plan applied to a linen module's calls.

:class:`PolicyModule` runs ``init`` and ``apply`` under the engine
(:func:`~.interpreter.apply_rules`) with every module method call
intercepted (``flax.linen.intercept_methods``). A call into a module from
outside it is a *boundary*: its floating inputs are cast to the module's
compute dtype and its outputs to what the plan says, its params are read in
their dtype, and its ops run in a named scope of its compute dtype. A
module's own helper methods (called by the module itself) are not
boundaries: they run as the code wrote them, inside the caller's.

Params are read through the module's scope as they are read (flax's
``Scope.param``, set for the call): so ``init``, ``apply`` and any trace of
either read them in the same dtype, and no abstract trace is needed to learn
which module owns which param.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax

from jmp_lab._src.numerics import fp8_state
from jmp_lab.kernels import pytrees
from jmp_lab._src.precision import linen_layers, scopes
from jmp_lab._src.precision import rules as rules_lib
from jmp_lab._src.precision import agreement
from jmp_lab._src.precision.interpreter import (apply_rules, is_tracing,
                                                outputs_in)
from jmp_lab._src.precision.plan import Decision, Plan
from jmp_lab._src.precision.rules import make_rules
from jmp_lab._src.numerics.attention import attention_fn
from jmp_lab._src.policy import Policy, cast_floating, get_policy


@dataclasses.dataclass(frozen=True)
class PolicyModule:
  """A linen module with a precision policy; see
  :func:`jmp_lab.linen.with_policy`. ``init`` and ``apply`` mirror linen's."""

  module: nn.Module
  plan: Plan
  fp8_history_length: int = fp8_state.AMAX_HISTORY_LENGTH
  cache_dtype: Optional[str] = None

  @property
  def policy(self) -> Policy:
    return self.plan.policy

  def init(self, rngs, *args, method=None, **kwargs) -> dict:
    """``module.init`` with every module call under the policy (params read
    as ``apply`` reads them), the params cast to its ``param_dtype``. The
    forward pass init makes is not re-evaluated under the op rules: only
    the variables come back, and flax's initializers keep their values bit
    for bit."""
    # The forward pass is traced with the casts the policy makes, so ops
    # whose inputs must share a dtype need them agreed here too.
    interceptor = _Interceptor(self)
    with nn.intercept_methods(interceptor), agreement.agreeing():
      variables = dict(self.module.init(rngs, *args, method=method, **kwargs))
    rules_lib.warn_unmatched_path_overrides(
        self.plan.rules, interceptor.paths, type(self.module).__name__)
    if "params" in variables:
      variables["params"] = self.policy.cast_to_param(variables["params"])
    return variables

  def apply(self, variables: Mapping[str, Any], *args, rngs=None,
            mutable=False, method=None, **kwargs) -> Any:
    """``module.apply`` under the policy; same arguments and results."""
    result = self._run(self.module.apply)(dict(variables), *args, rngs=rngs,
                                          mutable=mutable, method=method,
                                          **kwargs)
    # The model's outputs in its output dtype where the interpreter chose
    # another for them (interpreter.outputs_in); the mutated variables keep
    # theirs.
    output = self.plan.output_dtype(self.plan.decide([("", self.module)]),
                                    True)
    if mutable is False and not kwargs.get("capture_intermediates"):
      return outputs_in(result, output)
    out, mutated = result  # Flax's (outputs, variables)
    return outputs_in(out, output), mutated

  def __call__(self, variables, *args, **kwargs):
    return self.apply(variables, *args, **kwargs)

  def _run(self, fn: Callable) -> Callable:
    reduce_dtype = self.policy.reduce_dtype

    def intercepted(*args, **kwargs):
      with nn.intercept_methods(_Interceptor(self)), (
          scopes.reduce_scope(reduce_dtype) if reduce_dtype is not None
          else contextlib.nullcontext()):
        return fn(*args, **kwargs)

    if is_tracing():
      # Already under the engine (a train step's loss): its rules read the
      # scopes the module calls open.
      return intercepted
    return apply_rules(intercepted, make_rules(self.policy.compute_dtype))


def _chain(module: nn.Module) -> list[tuple[str, nn.Module]]:
  """``(path, module)`` from ``module`` up to the model."""
  chain = []
  while isinstance(module, nn.Module):
    chain.append(("/".join(module.path), module))
    module = module.parent
  return chain


class _Interceptor:
  """Applies the plan at every boundary call of one ``init``/``apply``."""

  def __init__(self, owner: PolicyModule):
    self.plan = owner.plan
    self.history_length = owner.fp8_history_length
    self.cache_dtype = owner.cache_dtype
    self.calls: list[nn.Module] = []  # boundary calls running, innermost last
    # The path of every module called and of every param read, as the plan
    # matches them (unmatched path overrides are warned of after init).
    self.paths: set[str] = set()
    # id(module) of a module applied inside another's call (Hugging Face's
    # tied head: ``self.lm_head.apply({"params": {"kernel": ...}}, x)``), a
    # root of its own: (the module, kept alive so that its id is not reused;
    # its path under its caller; the caller's chain).
    self.nested: dict[int, tuple[nn.Module, str, list]] = {}

  def __call__(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    self._note_if_nested(module)
    path = self._path_chain(module)[0][0]
    if module.scope is not None:
      self.paths.add(path)
    if method == "setup":  # params made in setup are read by the plan too
      decision = self._decide(module)
      with _reading_params(module, self.plan, decision, (), {},
                           self.paths, path), \
          _policed_state(module, decision, self.cache_dtype):
        return next_fun(*args, **kwargs)
    if (method.startswith("_") and method != "__call__") or (
        self.calls and self.calls[-1] is module):
      return next_fun(*args, **kwargs)  # a helper: not a boundary
    decision = self._decide(module)
    top = not self.calls
    if not decision.as_written:
      with scopes.policy_cast_scope():
        args, kwargs = cast_floating((args, kwargs), decision.compute_dtype)
    attach = (linen_layers.attached_params(module, self.plan, decision)
              if method == "__call__" else ())
    attached: dict = {}
    self.calls.append(module)
    try:
      with _reading_params(module, self.plan, decision, attach, attached,
                           self.paths, path), \
          _policed_state(module, decision, self.cache_dtype):
        out = linen_layers.call_layer(
            next_fun, module, method, args, kwargs, self.plan, decision,
            self.history_length, dot_product_attention)
    finally:
      self.calls.pop()
    if attached:
      out = linen_layers.attach_gradients(
          module, out, attached, args, kwargs, decision.compute_dtype,
          decision.policy.reduce_dtype)
    output = self.plan.output_dtype(decision, top)
    if output is None:
      return out
    with scopes.policy_cast_scope():
      return cast_floating(out, output)

  def _decide(self, module: nn.Module) -> Decision:
    return self.plan.decide(self._path_chain(module))

  def _note_if_nested(self, module: nn.Module) -> None:
    """Records a module applied as a root of its own inside another
    module's call, under the caller's path and its own name. (A module
    that a lifted transform, ``nn.scan`` or ``nn.remat``, cloned onto a
    scope of its own keeps its whole path: not a root.)"""
    if (isinstance(module.parent, nn.Module) or module.path
        or not self.calls or not module.name or id(module) in self.nested
        or any(call is module for call in self.calls)):
      return
    outer = self._path_chain(self.calls[-1])
    path = f"{outer[0][0]}/{module.name}" if outer[0][0] else module.name
    self.nested[id(module)] = (module, path, outer)

  def _path_chain(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` from ``module`` up to the model, through the
    call that applied a nested root (its paths under the caller's)."""
    chain = _chain(module)
    nested = self.nested.get(id(chain[-1][1]))
    if nested is None:
      return chain
    _, prefix, outer = nested
    return [(f"{prefix}/{path}" if path else prefix, m)
            for path, m in chain] + outer


@contextlib.contextmanager
def _reading_params(module: nn.Module, plan: Plan, decision: Decision,
                    attach: tuple[str, ...], attached: dict,
                    read_paths: set, prefix: str):
  """For the block: ``module``'s params are read in the dtype the plan
  gives each; those named in ``attach`` through ``stop_gradient``, their
  differentiable values put in ``attached`` (their gradients are attached
  after the call, summed in the reduce dtype); each param's path, as the
  plan matches it, put in ``read_paths``. Flax has no hook for a param
  read, so the module's scope's ``param`` is set for the block."""
  scope = module.scope
  if scope is None:
    yield
    return
  read = scope.param
  before = scope.__dict__.get("param")
  # An embedding's table is not a weight matmul's: a tie written by hand
  # (x @ embed.embedding.T) stays in the compute dtype, as Embed.attend.
  lookup_table = isinstance(module, nn.Embed)

  def param(name, init_fn, *init_args, unbox=True, **init_kwargs):
    value = read(name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    path = f"{prefix}/{name}" if prefix else name
    read_paths.add(path)
    dtype = plan.param_dtype(decision, path)
    with scopes.policy_cast_scope(), (
        contextlib.nullcontext() if lookup_table
        else scopes.param_read_scope()):
      cast = value if dtype is None else cast_floating(value, dtype)
    if name in attach:
      attached[name] = value
      return jax.lax.stop_gradient(cast)
    return cast

  scope.param = param
  try:
    yield
  finally:
    if before is None:
      del scope.param
    else:
      scope.param = before


def _reconciled(value: Any, stored: Any) -> Any:
  """``value`` with each floating array cast to the dtype of the array
  ``stored`` holds at its place (the same structure; else as it is)."""
  if stored is None:
    return value
  floating = lambda x: (hasattr(x, "dtype")  # noqa: E731  (arrays, structs)
                        and jax.numpy.issubdtype(x.dtype, jax.numpy.floating))
  try:
    return jax.tree_util.tree_map(
        lambda v, s: v.astype(s.dtype) if (pytrees.is_floating_array(v)
                                           and floating(s)) else v,
        value, stored)
  except (ValueError, TypeError):  # another structure (a sown tuple grows)
    return value


@contextlib.contextmanager
def _policed_state(module: nn.Module, decision: Decision,
                   cache_dtype: Optional[str]):
  """For the block: a value ``module`` writes into a variable outside
  ``params`` (a KV cache, a buffer, a counter) is cast to the dtype the
  variable holds, as torch casts a bf16 write into a float32 buffer; the
  ``cache`` collection is read in the compute dtype, so a decode step that
  writes this step's keys into it (``dynamic_update_slice``) sees one
  dtype; with ``cache_dtype="compute"`` a new cache is stored in it. Flax
  has no hook for a variable's read and write: the module's scope's
  ``get_variable`` and ``put_variable`` are set for the block."""
  scope, compute = module.scope, decision.compute_dtype
  if scope is None or compute is None:
    yield
    return
  get, put = scope.get_variable, scope.put_variable
  saved = {name: scope.__dict__.get(name)
           for name in ("get_variable", "put_variable")}

  def get_variable(col, name, default=None):
    value = get(col, name, default)
    if col != "cache":
      return value
    with scopes.policy_cast_scope():
      return cast_floating(value, compute)

  def put_variable(col, name, value):
    if col != "params":
      stored = get(col, name)
      if stored is None and col == "cache" and cache_dtype == "compute":
        stored = jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(v.shape, compute), value)
      with scopes.policy_cast_scope():
        value = _reconciled(value, stored)
    put(col, name, value)

  scope.get_variable, scope.put_variable = get_variable, put_variable
  try:
    yield
  finally:
    for name, before in saved.items():
      if before is None:
        delattr(scope, name)
      else:
        setattr(scope, name, before)


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None, *,
                          causal: bool = False, segment_ids=None,
                          implementation: str = "auto"):
  """``attention_fn`` for ``nn.MultiHeadDotProductAttention`` (and
  ``nn.SelfAttention``) with an fp32 softmax: flax's signature over
  :func:`jmp_lab.attention.attention_fn`, which both front ends share.

  With ``causal=True`` or ``segment_ids`` and no mask, bias, dropout or
  sown weights, it runs :func:`jmp_lab.attention.dot_product_attention`:
  a fused kernel on CUDA, with the softmax statistics in fp32 and no stored
  scores, and the materialized fp32-softmax path elsewhere. Its operands go
  in the compute dtype of the policy around it, even from a layer given
  ``dtype=jnp.float32``. Otherwise the scores are materialized, with the
  mask, softmax and dropout in fp32 (grouped-query attention included).
  :func:`jmp_lab.linen.with_policy` gives it to flax's attention modules
  that use flax's default ``attention_fn``.

  Example::

    >>> import functools, flax.linen as nn, jmp_lab.linen as jl
    >>> attention = nn.SelfAttention(num_heads=4, attention_fn=functools.partial(
    ...     jl.dot_product_attention, causal=True))   # call it without a mask
  """
  sow = None
  if module is not None:
    sow = lambda w: module.sow("intermediates", "attention_weights", w)  # noqa: E731
  return attention_fn(query, key, value, bias, mask,
                      broadcast_dropout=broadcast_dropout,
                      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                      deterministic=deterministic, dtype=dtype,
                      precision=precision, causal=causal,
                      segment_ids=segment_ids, implementation=implementation,
                      sow=sow)


def with_policy(module: nn.Module, policy: Any, *, rules=(),
                class_overrides=None, path_overrides=None,
                fp32_norms: bool = True,
                fp8_history_length: int = fp8_state.AMAX_HISTORY_LENGTH,
                keep_layer_dtypes: bool = False,
                cache_dtype: Optional[str] = None) -> PolicyModule:
  """See :func:`jmp_lab.linen.with_policy` (the face holds the docs)."""
  if cache_dtype not in (None, "compute"):
    raise ValueError(f"cache_dtype must be None (caches keep their dtype) or "
                     f"'compute' (stored in the compute dtype), got "
                     f"{cache_dtype!r}")
  if isinstance(module, PolicyModule):
    raise TypeError(
        "with_policy got a model that already has a policy (a "
        "jmp_lab.linen.PolicyModule, from with_policy): apply the policy "
        "once, to the flax module (with_policy(module, policy)); its "
        "overrides go in that one call")
  if not isinstance(module, nn.Module):
    raise TypeError(
        f"with_policy needs a flax.linen.Module, got {type(module).__name__}")
  if not isinstance(fp8_history_length, int) or fp8_history_length < 1:
    raise ValueError(f"fp8_history_length must be a positive int, got "
                     f"{fp8_history_length!r}")
  policy = get_policy(policy)
  plan = Plan(policy, rules_lib.rules_from_options(
      policy, rules=rules, class_overrides=class_overrides,
      path_overrides=path_overrides, fp32_norms=fp32_norms,
      keep_layer_dtypes=keep_layer_dtypes, embed_classes=(nn.Embed,)))
  return PolicyModule(module, plan, fp8_history_length, cache_dtype)
