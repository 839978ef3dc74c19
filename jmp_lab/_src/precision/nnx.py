"""The NNX front end: the plan applied to a constructed NNX module graph.

NNX has no method interceptor (linen's ``intercept_methods``), so a
module's call is its class's ``__call__``. :func:`with_policy` asks the plan
once per module and makes the answers part of the graph:

* each module's class becomes a subclass of its own class
  (:func:`_policy_class`, one per class and decision, cached;
  ``isinstance``, attribute names, graph paths and checkpoints are
  unchanged) whose ``__call__`` (and an embedding's ``attend``) casts its
  inputs and outputs and runs in a named scope of its compute dtype; the
  outermost policed call runs the engine (:func:`_under_rules`);
* each ``nnx.Param`` becomes a :class:`PolicyParam`, the custom ``Variable``
  type Flax recommends for cast-on-read: its stored value stays in
  ``param_dtype`` and ``param[...]`` returns it in the dtype the plan gives
  it, in Flax's layers and in your own modules alike, inside a policed
  call. Gradients flow back through the cast to the stored dtype.

A module's other methods are not boundaries: they run as written, inside
the call that called them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx

from jmp_lab._src.numerics import fp8_state
from jmp_lab._src.numerics import reduce as reduce_lib
from jmp_lab.kernels import pytrees
from jmp_lab._nesting import Nesting
from jmp_lab._src.precision import interpreter, nnx_layers, scopes
from jmp_lab._src.precision import rules as rules_lib
from jmp_lab._src.precision.interpreter import is_tracing
from jmp_lab._src.precision.nnx_layers import Fp8State, base_class, swapped
from jmp_lab._src.precision.plan import Decision, Plan
from jmp_lab._src.precision.rules import make_rules
from jmp_lab._src.numerics.attention import attention_fn
from jmp_lab._src.policy import cast_floating, get_policy, layer_dtype

# The params read through stop_gradient for one layer call (by id): their
# gradient is attached after the call, in the reduce dtype (_policy_class).
_DETACHED: set = set()

# How many policed module calls are running on this thread: a param is read
# in its compute dtype inside one, and as stored outside (nnx.state,
# nnx.to_pure_dict, checkpoints, your own code between calls).
_MODULE_CALLS = Nesting()


def _read_in_compute_dtype(variable_class: type) -> Callable:
  def get_value(self, **kwargs):
    value = variable_class.get_value(self, **kwargs)
    if not _MODULE_CALLS.active:
      return value
    dtype = self.get_metadata("compute_dtype", None)
    if dtype is not None:
      with scopes.policy_cast_scope(), (
          contextlib.nullcontext() if self.get_metadata("lookup_table", False)
          else scopes.param_read_scope()):
        value = cast_floating(value, dtype)
    return jax.lax.stop_gradient(value) if id(self) in _DETACHED else value
  return get_value


@contextlib.contextmanager
def _detached(variable: nnx.Variable):
  """For one call: ``variable`` reads through ``stop_gradient``; yields its
  differentiable read."""
  value = variable.get_value()
  _DETACHED.add(id(variable))
  try:
    yield value
  finally:
    _DETACHED.discard(id(variable))


class PolicyParam(nnx.Param):
  """An ``nnx.Param`` read in its module's compute dtype inside a call.

  Inside a policed module's call, ``param[...]`` (and every other read)
  returns the value cast to the ``compute_dtype`` metadata. Outside one
  (``nnx.state``, ``nnx.to_pure_dict``, Flax's and orbax's checkpoint
  routes, your own code between calls) it is the stored value, in the
  policy's ``param_dtype``, as is ``param.get_raw_value()`` anywhere.
  :func:`jmp_lab.nnx.with_policy` makes them.
  """

  get_value = _read_in_compute_dtype(nnx.Param)
  # What a copy of it that is not read by a module (an optimizer state's
  # master or moment) is: the user's class, without this metadata.
  _jmp_lab_stored_class = nnx.Param
  _jmp_lab_read_metadata = "compute_dtype"


@functools.lru_cache(maxsize=None)
def _written_in_stored_dtype(variable_class: type) -> Callable:
  def set_value(self, value, **kwargs):
    # Inside a policed call a value computed in the compute dtype lands in
    # a buffer of another float dtype (a float32 KV cache): cast to the
    # destination's dtype, as torch's copy into a float32 buffer does.
    if _MODULE_CALLS.active:
      stored = self.get_raw_value()
      if (pytrees.is_floating_array(stored) and pytrees.is_floating_array(value)
          and value.dtype != stored.dtype):
        with scopes.policy_cast_scope():
          value = value.astype(stored.dtype)
    return variable_class.set_value(self, value, **kwargs)
  return set_value


def _state_class(cls: type, read_in_compute: bool) -> type:
  """``cls`` whose writes inside a policed call keep its stored dtype; with
  ``read_in_compute`` (a cache) also read in the ``compute_dtype``
  metadata there. Its own type for filters (``nnx.Cache`` stays one)."""
  if getattr(cls, "_jmp_lab_state", None) is not None:
    cls = cls.__mro__[1]  # called again: from the user's class
  return _made_state_class(cls, read_in_compute)


@functools.lru_cache(maxsize=None)
def _made_state_class(cls: type, read_in_compute: bool) -> type:
  methods = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "set_value": _written_in_stored_dtype(cls),
             "_jmp_lab_state": "cache" if read_in_compute else "state"}
  if read_in_compute:
    methods["get_value"] = _read_in_compute_dtype(cls)
  return type(cls.__name__, (cls,), methods)


def _cast_on_read_class(cls: type) -> type:
  if issubclass(cls, PolicyParam) or getattr(cls, "_jmp_lab_cast_on_read",
                                             False):
    return cls
  if cls is nnx.Param:
    return PolicyParam
  # A Param subclass (e.g. nnx.LoRAParam) keeps its type for filters.
  return type(cls.__name__, (cls,), {
      "__module__": cls.__module__, "__qualname__": cls.__qualname__,
      "get_value": _read_in_compute_dtype(cls), "_jmp_lab_cast_on_read": True,
      "_jmp_lab_stored_class": cls, "_jmp_lab_read_metadata": "compute_dtype"})


def _cast_arrays(tree: Any, dtype: Optional[np.dtype]) -> Any:
  """Floating arrays of ``tree`` in ``dtype`` (None: unchanged); NNX
  objects (a ``Rngs``, a submodule passed as an argument) are passed on as
  they are."""
  if dtype is None:
    return tree
  with scopes.policy_cast_scope():
    return jax.tree_util.tree_map(
        lambda x: x if interpreter.is_nnx_object(x) else cast_floating(x, dtype), tree,
        is_leaf=interpreter.is_nnx_object)


def _under_rules(module: nnx.Module, method: str, compute: np.dtype,
                 args: tuple, kwargs: dict,
                 output: Optional[np.dtype]) -> Any:
  """``module.<method>(*args, **kwargs)`` under the engine, in
  ``compute``, its floating outputs in ``output`` (None: as they come)."""
  return interpreter.call_under_rules(
      lambda m, *a, **k: getattr(m, method)(*a, **k), (module, *args), kwargs,
      make_rules(compute), output_dtype=output)


@functools.lru_cache(maxsize=None)
def _policy_class(base: type, compute: np.dtype, cast_inputs: bool,
                  output: Optional[np.dtype],
                  own_dtype: Optional[np.dtype], fp8_delayed: bool = False,
                  reduce_bias: Optional[np.dtype] = None,
                  attend: Optional[tuple[np.dtype, np.dtype]] = None,
                  cache_dtype: Optional[str] = None,
                  own_matmul: Optional[str] = None) -> type:
  """``base`` whose ``__call__`` runs in ``compute`` (its inputs cast to it
  with ``cast_inputs``) and returns ``output`` (None: as it comes), with
  the layer's own ``dtype`` set to ``own_dtype`` for the call; with
  ``fp8_delayed``, its matmul in fp8 scaled by its
  :class:`~.nnx_layers.Fp8State`; with ``reduce_bias``, its bias gradient
  summed in that dtype; with ``own_matmul``, the weight matmuls its own
  code writes in that ``matmul=`` format (:meth:`.Plan.own_matmul`).
  An ``Embed``'s ``attend`` is a boundary too; with ``attend=(compute
  dtype, reduce dtype)`` its GEMM runs in that compute dtype with the
  table's gradient summed in the reduce dtype."""

  def __call__(self, *args, **kwargs):
    _police_new_state(self, compute, cache_dtype)
    if not is_tracing():  # the outermost policed call: it runs the engine
      return _under_rules(self, "__call__", compute, args, kwargs, output)
    args, kwargs = _cast_arrays((args, kwargs), compute if cast_inputs
                                else None)
    bias, bias_inside = None, False
    with contextlib.ExitStack() as stack:
      stack.enter_context(scopes.module_scope(compute, own_matmul))
      stack.enter_context(_MODULE_CALLS.enter())
      if own_dtype is not None:
        stack.enter_context(swapped(self, "dtype", own_dtype))
      if fp8_delayed:
        bias_inside = nnx_layers.delayed_fp8_matmul(self, compute, stack)
      else:
        nnx_layers.current_fp8_operands(self, compute, stack)
      if reduce_bias is not None and not bias_inside:
        bias = stack.enter_context(_detached(self.bias))
      out = base.__call__(self, *args, **kwargs)
    if bias is not None:
      broadcast = nnx_layers.bias_broadcast(self, bias.shape, args, kwargs)
      out = reduce_lib.with_param_gradient(
          lambda g, _: reduce_lib.bias_gradient(g, broadcast, reduce_bias),
          out, bias, ())
    return _cast_arrays(out, output)

  methods = {"__call__": __call__}
  if hasattr(base, "attend"):
    methods["attend"] = _attend_method(base, compute, cast_inputs, output,
                                       attend)
  # A plain subclass, no slots or mixins: instances keep their layout, so
  # their class can be swapped in place.
  return type(base.__name__, (base,), {
      "__module__": base.__module__, "__qualname__": base.__qualname__,
      **methods, "_jmp_lab_base": base,
      "_jmp_lab_dtypes": (compute, output)})


def _attend_method(base: type, compute: np.dtype, cast_inputs: bool,
                   output: Optional[np.dtype],
                   reduced: Optional[tuple[np.dtype, np.dtype]]) -> Callable:
  """``Embed.attend`` (the logits GEMM of tied embeddings) under the rules,
  as ``__call__``."""
  gemm_dtype = compute if reduced is None else reduced[0]

  def attend(self, query, *args, **kwargs):
    if not is_tracing():
      return _under_rules(self, "attend", gemm_dtype, (query, *args), kwargs,
                          output)
    query = _cast_arrays(query, gemm_dtype if cast_inputs else None)
    with scopes.scope(gemm_dtype), _MODULE_CALLS.enter():
      if reduced is not None and base.attend is nnx.Embed.attend:
        out = reduce_lib.embed_attend(query, self.embedding.get_raw_value(),
                                      *reduced)
      else:
        out = base.attend(self, query, *args, **kwargs)
    return _cast_arrays(out, output)

  return attend


def _chain(path: tuple, modules: dict) -> list[tuple[str, Any]]:
  """``(path, module)`` from the module at ``path`` up to the model."""
  return [("/".join(map(str, path[:end])), modules[path[:end]])
          for end in range(len(path), -1, -1) if path[:end] in modules]


def _own_dtype(module: nnx.Module, plan: Plan, decision: Decision
               ) -> Optional[np.dtype]:
  """What the layer's own ``dtype`` attribute is for its calls (None:
  left as it is, or the layer has none)."""
  if not hasattr(module, "dtype") or (module.dtype is not None
                                      and layer_dtype(module) is None):
    return None
  return plan.layer_dtype(decision)


def _policed_state(model: nnx.Module, modules: dict, decisions: dict,
                   cache_dtype: Optional[str]) -> None:
  """Every floating non-param variable (a cache, a buffer, a counter; not
  a batch statistic, which the norms keep in fp32) keeps its stored dtype
  when a policed call writes it; a ``nnx.Cache`` is also read in its
  module's compute dtype there, so a decode step that writes this step's
  keys into it (``dynamic_update_slice``) sees one dtype. With
  ``cache_dtype="compute"`` the caches are stored in it too."""
  for path, variable in nnx.iter_graph(model):
    if _is_module_state(variable):
      owner = next(path[:end] for end in range(len(path) - 1, -1, -1)
                   if path[:end] in modules)
      _police_state_variable(variable, decisions[owner].compute_dtype,
                             cache_dtype)


def _is_module_state(variable: Any) -> bool:
  """A floating variable a module writes as it runs: a cache, a buffer, a
  counter (not a param, a batch statistic, fp8 scaling state, or what
  ``sow`` and ``perturb`` record)."""
  return (isinstance(variable, nnx.Variable)
          and not isinstance(variable, (nnx.Param, nnx.BatchStat, Fp8State,
                                        nnx.Intermediate, nnx.Perturbation))
          and getattr(type(variable), "_jmp_lab_state", None) is None
          and pytrees.is_floating_array(variable.get_raw_value()))


def _police_state_variable(variable: nnx.Variable,
                           compute: Optional[np.dtype],
                           cache_dtype: Optional[str]) -> None:
  is_cache = isinstance(variable, nnx.Cache) and compute is not None
  if is_cache and cache_dtype == "compute":
    variable.set_raw_value(variable.get_raw_value().astype(compute),
                           _unsafe_bypass_check=True)
  variable.__class__ = _state_class(type(variable), is_cache)
  if is_cache:
    variable.set_metadata(compute_dtype=compute)


def _police_new_state(module: nnx.Module, compute: Optional[np.dtype],
                      cache_dtype: Optional[str]) -> None:
  """The module's own state variables made after ``with_policy`` (Flax's
  ``MultiHeadAttention.init_cache`` makes its KV cache when decoding
  starts) get the same treatment, at the module's next call."""
  for value in list(vars(module).values()):
    if _is_module_state(value):
      _police_state_variable(value, compute, cache_dtype)


def apply_plan(model: nnx.Module, plan: Plan, history_length: int,
               cache_dtype: Optional[str] = None) -> None:
  """Makes ``plan``'s answers part of ``model``'s graph (see the module
  doc); calling it again replaces an earlier plan."""
  modules = dict(nnx.iter_modules(model))
  decisions = {path: plan.decide(_chain(path, modules)) for path in modules}
  for path, module in modules.items():
    decision = decisions[path]
    mode = nnx_layers.matmul_mode(plan, decision, module)
    nnx_layers.set_matmul(module, mode, None if decision.as_written
                          else decision.policy.reduce_dtype, history_length)
    attend = (plan.tied_logits(decision)
              if isinstance(module, nnx.Embed) else None)
    module.__class__ = _policy_class(
        base_class(module), decision.compute_dtype, not decision.as_written,
        plan.output_dtype(decision, path == ()),
        _own_dtype(module, plan, decision), mode == "fp8",
        nnx_layers.bias_reduce_dtype(module, plan, decision, mode), attend,
        cache_dtype,
        plan.own_matmul(decision, mode, nnx_layers.layer_kind(module)[1]))
    if (isinstance(module, nnx.MultiHeadAttention)
        and module.attention_fn is nnx.dot_product_attention):
      module.attention_fn = dot_product_attention
  for path, variable in nnx.iter_graph(model):
    if not isinstance(variable, nnx.Param):
      continue
    owner = next(path[:end] for end in range(len(path) - 1, -1, -1)
                 if path[:end] in modules)
    read = plan.param_dtype(decisions[owner], "/".join(map(str, path)))
    value = variable.get_raw_value()
    if pytrees.is_floating_array(value):
      variable.set_raw_value(value.astype(plan.policy.param_dtype),
                             _unsafe_bypass_check=True)
    variable.__class__ = _cast_on_read_class(type(variable))
    variable.set_metadata(compute_dtype=read)
    if isinstance(modules[owner], nnx.Embed):
      # Not a weight matmul's (a tie written by hand stays in the compute
      # dtype, as Embed.attend): scopes.param_read_scope.
      variable.set_metadata(lookup_table=True)
  _policed_state(model, modules, decisions, cache_dtype)


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None,
                          promote_dtype=None, is_causal: bool = False, *,
                          causal: bool = False, segment_ids=None,
                          implementation: str = "auto"):
  """``nnx.dot_product_attention`` with the softmax in fp32: NNX's signature
  over :func:`jmp_lab.attention.attention_fn`, which both front ends share
  (grouped-query attention included).

  With ``causal=True`` (or flax's ``is_causal``) or ``segment_ids`` and no
  mask, bias, dropout or sown weights, it runs
  :func:`jmp_lab.attention.dot_product_attention`: a fused kernel on CUDA
  (fp32 softmax statistics, no stored scores) and the materialized path
  elsewhere, in the compute dtype of the policy around it. Otherwise the
  scores are materialized: the two matmuls (and their gradients) run in the
  inputs' dtype, and the mask, softmax and dropout are fp32. The weights
  are cast back for the second matmul. Flax's own computes the softmax in
  the input dtype. :func:`jmp_lab.nnx.with_policy` gives it to every
  ``nnx.MultiHeadAttention`` that uses Flax's default. ``promote_dtype`` is
  accepted and unused (the policy has cast the inputs).

  Example::

    >>> import functools, jmp_lab
    >>> from flax import nnx
    >>> attention = nnx.MultiHeadAttention(
    ...     num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
    ...     attention_fn=functools.partial(jmp_lab.nnx.dot_product_attention,
    ...                                    causal=True))  # call it without a mask
  """
  del promote_dtype
  sow = None
  if module is not None:
    sow = lambda w: module.sow(nnx.Intermediate, "attention_weights", w)  # noqa: E731
  return attention_fn(query, key, value, bias, mask,
                      broadcast_dropout=broadcast_dropout,
                      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                      deterministic=deterministic, dtype=dtype,
                      precision=precision, causal=causal or is_causal,
                      segment_ids=segment_ids, implementation=implementation,
                      sow=sow)


def with_policy(model: nnx.Module, policy: Any, *, rules=(),
                class_overrides=None, path_overrides=None,
                fp32_norms: bool = True,
                fp8_history_length: int = fp8_state.AMAX_HISTORY_LENGTH,
                keep_layer_dtypes: bool = False,
                cache_dtype: Optional[str] = None) -> nnx.Module:
  """See :func:`jmp_lab.nnx.with_policy` (the face holds the docs)."""
  if cache_dtype not in (None, "compute"):
    raise ValueError(f"cache_dtype must be None (caches keep their dtype) or "
                     f"'compute' (stored in the compute dtype), got "
                     f"{cache_dtype!r}")
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"jmp_lab.nnx.with_policy needs a flax.nnx.Module, got "
        f"{type(model).__name__}; for linen modules use "
        f"jmp_lab.linen.with_policy")
  if not isinstance(fp8_history_length, int) or fp8_history_length < 1:
    raise ValueError(f"fp8_history_length must be a positive int, got "
                     f"{fp8_history_length!r}")
  policy = get_policy(policy)
  plan = Plan(policy, rules_lib.rules_from_options(
      policy, rules=rules, class_overrides=class_overrides,
      path_overrides=path_overrides, fp32_norms=fp32_norms,
      keep_layer_dtypes=keep_layer_dtypes, embed_classes=(nnx.Embed,)))
  apply_plan(model, plan, fp8_history_length, cache_dtype)
  rules_lib.warn_unmatched_path_overrides(
      plan.rules, ("/".join(map(str, path)) for path, node in
                   nnx.iter_graph(model)
                   if isinstance(node, (nnx.Module, nnx.Variable))),
      type(model).__name__)
  return model
