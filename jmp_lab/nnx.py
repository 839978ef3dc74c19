"""Precision policies and a mixed-precision optimizer for Flax NNX.

:func:`with_policy` applies a :class:`~jmp_lab.Policy` to a constructed NNX
module graph, with the meaning of :func:`jmp_lab.linen.with_policy`:

* params are stored in ``param_dtype`` and read in the compute dtype of the
  module that owns them;
* every module casts its floating inputs to its compute dtype and its
  outputs to the compute dtype (the model's own outputs to ``output_dtype``);
* overrides by class or by a regular expression over the graph path
  (``"blocks/0/attn"``, or a param's ``"head/kernel"``); norms compute in
  fp32 by default and hand back the compute dtype; batch statistics stay
  fp32 (only ``nnx.Param`` variables are ever cast);
* ``nnx.MultiHeadAttention`` with Flax's default ``attention_fn`` gets
  :func:`dot_product_attention`, whose softmax is fp32;
* with a ``reduce`` dtype, ``Linear``, ``LinearGeneral``, ``Conv`` and
  ``Einsum`` compute their weight gradients in it (:mod:`jmp_lab.reduce`),
  ``Embed`` reads its table in it, and every bias of those layers and of
  ``ConvTranspose`` is summed over the batch in it.

Module code does not change. How: NNX has no method interceptor (linen's
``intercept_methods``), so a module's call is its class's ``__call__``:

* each module's class becomes a subclass of its own class whose ``__call__``
  casts inputs and outputs (one subclass per class and dtypes, cached;
  ``isinstance``, attribute names, graph paths and checkpoints are
  unchanged);
* each ``nnx.Param`` becomes a :class:`PolicyParam`, the custom ``Variable``
  type Flax recommends for cast-on-read: its stored value stays in
  ``param_dtype`` (what ``nnx.state``, the optimizer and checkpoints see) and
  ``param[...]`` returns it in the compute dtype, in Flax's layers and in your
  own modules alike. Gradients flow back through the cast to the stored dtype.

Setting Flax's own ``dtype``/``promote_dtype`` attributes instead would reach
only Flax's layers (not a custom module's ``x @ self.w[...]``, whose fp32
param would silently promote the matmul to fp32), and cannot hand an fp32
island's output back in the compute dtype for every layer.

:class:`Optimizer` is ``nnx.Optimizer`` for a jmp_lab optimizer
(:func:`jmp_lab.mixed_precision` or :func:`jmp_lab.fused_adamw`): fp32 master
(or remainder), loss scale, skipped non-finite steps, params written as
``cast(master)``. :func:`train_step` / :func:`make_train_step` are the step,
with the linen step's metrics; :func:`split_train_step` is the same step as a
pure function of the split state (for ``jax.jit``, the audit and compiled
reports).

Example::

  >>> import jax.numpy as jnp, optax, jmp_lab
  >>> from flax import nnx
  >>> class MLP(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.up, self.norm = nnx.Linear(3, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs)
  ...     self.down = nnx.Linear(8, 2, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.down(self.norm(self.up(x)))
  >>> model = jmp_lab.nnx.with_policy(MLP(nnx.Rngs(0)), "mixed_bfloat16")
  >>> optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
  ...     optax.adam(1e-3), policy="mixed_bfloat16",
  ...     loss_scale=jmp_lab.DynamicLossScale()), wrt=nnx.Param)
  >>> x = jnp.ones((4, 3))
  >>> model(x).dtype, model.up.kernel.get_raw_value().dtype  # f32 out, f32 stored
  (dtype('float32'), dtype('float32'))
  >>> loss_fn = lambda model, batch: jnp.mean(model(batch) ** 2)
  >>> step = jmp_lab.nnx.make_train_step(loss_fn)
  >>> metrics = step(model, optimizer, x)
  >>> sorted(metrics)
  ['grads_finite', 'loss', 'loss_scale', 'skipped_steps']
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmp_lab import _checks, _tree, fp8
from jmp_lab._nesting import Nesting
from jmp_lab import attention as attention_lib
from jmp_lab import reduce as reduce_lib
from jmp_lab.autocast import (apply_rules, is_tracing, make_rules,
                              policy_cast_scope, recording, warn_unless_half)
from jmp_lab.autocast import scope as autocast_scope
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.linen import fp32_island, kernel_dtype, layer_island, reduce_island
from jmp_lab.losses import (log_softmax, softmax,
                            softmax_cross_entropy_with_integer_labels)
from jmp_lab.loss_scale import LossScale, select_tree
from jmp_lab.policy import (Policy, cast_floating, get_policy,
                            is_norm_class, layer_dtype, resolve_overrides)
from jmp_lab.state import (FusedAdamWState, current_loss_scale, find_state,
                           last_step_applied, master_params, skipped_steps)
from jmp_lab.training import UPDATE_SCOPE, scaled_value_and_grad

DEFAULT_FP32_MODULES: tuple[type, ...] = (
    nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)

PolicySpec = Union[Policy, str]

# ---------------------------------------------------------------------------
# Cast-on-read params.
# ---------------------------------------------------------------------------


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
    value = value if dtype is None else cast_floating(value, dtype)
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


# Layers that add their bias broadcast over their output's leading axes
# (nnx.Einsum: over the axes its equation says).
_BIAS_MODULES = (nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose,
                 nnx.Einsum)


def _reduced_bias(module: nnx.Module, policy: Policy) -> Optional[np.dtype]:
  """The reduce dtype for ``module``'s bias gradient, if jmp_lab attaches it."""
  if (policy.reduce_dtype is None or _base_class(module) not in _BIAS_MODULES
      or not isinstance(getattr(module, "bias", None), nnx.Param)
      or getattr(module, "batch_axis", None)):
    return None
  return np.dtype(policy.reduce_dtype)


def _bias_broadcast(module: nnx.Module, bias_shape, args, kwargs) -> tuple:
  """How ``module`` broadcasts its bias onto its output (flax's rule)."""
  if not isinstance(module, nnx.Einsum):
    return tuple(bias_shape)
  inputs, subscripts = reduce_lib.flax_einsum_call(module, args, kwargs)
  return reduce_lib.einsum_bias_broadcast(subscripts, inputs,
                                          module.kernel.get_raw_value())


class PolicyParam(nnx.Param):
  """An ``nnx.Param`` read in its module's compute dtype inside a call.

  Inside a policed module's call, ``param[...]`` (and every other read)
  returns the value cast to the ``compute_dtype`` metadata. Outside one
  (``nnx.state``, ``nnx.to_pure_dict``, Flax's and orbax's checkpoint
  routes, your own code between calls) it is the stored value, in the
  policy's ``param_dtype``, as is ``param.get_raw_value()`` anywhere.
  :func:`with_policy` makes them.
  """

  get_value = _read_in_compute_dtype(nnx.Param)


@functools.lru_cache(maxsize=None)
def _cast_on_read_class(cls: type) -> type:
  if issubclass(cls, PolicyParam) or getattr(cls, "_jmp_lab_cast_on_read",
                                             False):
    return cls
  if cls is nnx.Param:
    return PolicyParam
  # A Param subclass (e.g. nnx.LoRAParam) keeps its type for filters.
  return type(cls.__name__, (cls,), {
      "__module__": cls.__module__, "__qualname__": cls.__qualname__,
      "get_value": _read_in_compute_dtype(cls), "_jmp_lab_cast_on_read": True})


# ---------------------------------------------------------------------------
# Modules that cast their inputs and outputs.
# ---------------------------------------------------------------------------


def _is_nnx_object(x: Any) -> bool:
  return isinstance(x, (nnx.Variable, nnx.Pytree))


def _cast_arrays(tree: Any, dtype: np.dtype) -> Any:
  """Floating arrays of ``tree`` in ``dtype``; NNX objects (a ``Rngs``, a
  submodule passed as an argument) are passed on as they are."""
  return jax.tree_util.tree_map(
      lambda x: x if _is_nnx_object(x) else cast_floating(x, dtype), tree,
      is_leaf=_is_nnx_object)


class Fp8Meta(nnx.Variable):
  """The delayed fp8 scaling state of one Linear (:func:`jmp_lab.fp8.init_meta`):
  differentiated by :func:`train_step`, which replaces it with
  :func:`jmp_lab.fp8.next_meta` of its gradient (the amaxes the step
  observed); never seen by the optimizer (``wrt=nnx.Param`` leaves it out)."""


def _under_rules(module: nnx.Module, method: str, compute: np.dtype,
                 args: tuple, kwargs: dict) -> Any:
  """``module.<method>(*args, **kwargs)`` under jmp_lab.autocast's rules.

  The engine traces a pure function, so the module graph (and any NNX
  object among the arguments, such as an ``nnx.Rngs``) is split, merged
  inside, and its new state (batch statistics, RNG counts) put back after:
  the pattern of NNX's own transforms.
  """
  nodes = [x for x in jax.tree_util.tree_leaves((args, kwargs),
                                                is_leaf=_is_nnx_object)
           if _is_nnx_object(x)]
  arrays = jax.tree_util.tree_map(
      lambda x: None if _is_nnx_object(x) else x, (args, kwargs),
      is_leaf=_is_nnx_object)
  graphdef, state = nnx.split((module, *nodes))

  def pure(state, arrays):
    merged = nnx.merge(graphdef, state)
    replaced = iter(merged[1:])
    call_args, call_kwargs = jax.tree_util.tree_map(
        lambda x, a: next(replaced) if _is_nnx_object(x) else a,
        (args, kwargs), arrays, is_leaf=_is_nnx_object)
    out = getattr(merged[0], method)(*call_args, **call_kwargs)
    return out, nnx.state(merged)

  out, new_state = apply_rules(pure, make_rules(compute))(state, arrays)
  changed = _changed_variables(state, new_state)
  if changed is None:  # the call made new variables: put back everything
    nnx.update((module, *nodes), new_state)
  elif changed:
    nnx.update((module, *nodes), nnx.from_flat_state(changed))
  return out


def _changed_variables(before: Any, after: Any) -> Optional[list]:
  """The ``(path, variable)`` pairs of ``after`` whose value is not the one
  in ``before`` (None if the two differ in their paths). Only these are put
  back: a plain forward pass writes nothing, so it may run inside
  ``jax.jit`` on a model made outside it, as a plain NNX module may."""
  old, new = list(nnx.to_flat_state(before)), list(nnx.to_flat_state(after))
  if [path for path, _ in old] != [path for path, _ in new]:
    return None
  raw = lambda v: v.get_raw_value() if isinstance(v, nnx.Variable) else v  # noqa: E731
  return [(path, n) for (path, o), (_, n) in zip(old, new)
          if raw(n) is not raw(o)]


@functools.lru_cache(maxsize=None)
def _policy_class(base: type, compute: np.dtype, output: np.dtype,
                  fp8_delayed: bool = False,
                  reduce_bias: Optional[np.dtype] = None,
                  attend: Optional[tuple[np.dtype, np.dtype]] = None) -> type:
  """``base`` whose ``__call__`` runs in ``compute`` and returns ``output``
  (with ``fp8_delayed``, its matmul in fp8 scaled by its :class:`Fp8Meta`;
  with ``reduce_bias``, its bias gradient summed in that dtype). Its
  matmuls run under jmp_lab.autocast's rules, in ``compute``. An ``Embed``'s
  ``attend`` does too; with ``attend=(compute dtype, reduce dtype)`` its
  GEMM runs in that compute dtype with the table's gradient summed in the
  reduce dtype."""

  def __call__(self, *args, **kwargs):
    if not is_tracing():  # the outermost policed call: it runs the engine
      return _under_rules(self, "__call__", compute, args, kwargs)
    with policy_cast_scope():
      args, kwargs = _cast_arrays((args, kwargs), compute)
    bias = None
    with contextlib.ExitStack() as stack:
      stack.enter_context(autocast_scope(compute))
      stack.enter_context(_MODULE_CALLS.enter())
      entry = _fp8_entry(self)
      bias_inside = fp8_delayed and _fp8_bias_inside(self)
      if fp8_delayed:
        # The layer calls its matmul attribute: for this call, the fp8
        # matmul that reads (and, differentiated, updates) its scaling state
        # (and adds the layer's bias: see _fp8_bias_inside).
        _, attribute, _, _, delayed = entry
        meta = self.fp8_meta.get_value()
        matmul = (delayed(meta, bias=self.bias[...]) if bias_inside
                  else delayed(meta))
        if bias_inside:  # flax's call then neither reads nor adds it
          stack.enter_context(_swapped(self, "bias", None))
          stack.enter_context(_swapped(self, "use_bias", False))
        stack.enter_context(_swapped(self, attribute, fp8.operands_in(
            matmul, compute, einsum=attribute == "einsum_op")))
      elif entry is not None and getattr(self, entry[1]) is entry[3]:
        stack.enter_context(_swapped(self, entry[1], fp8.operands_in(
            entry[3], compute, einsum=entry[1] == "einsum_op")))
      if reduce_bias is not None and not bias_inside:
        bias = stack.enter_context(_detached(self.bias))
      out = base.__call__(self, *args, **kwargs)
    if bias is not None:
      broadcast = _bias_broadcast(self, bias.shape, args, kwargs)
      out = reduce_lib.with_param_gradient(
          lambda g, _: reduce_lib.bias_gradient(g, broadcast, reduce_bias),
          out, bias, ())
    with policy_cast_scope():
      return _cast_arrays(out, output)

  methods = {"__call__": __call__}
  if hasattr(base, "attend"):
    methods["attend"] = _attend_method(base, compute, output, attend)
  # A plain subclass, no slots or mixins: instances keep their layout, so
  # their class can be swapped in place.
  return type(base.__name__, (base,), {
      "__module__": base.__module__, "__qualname__": base.__qualname__,
      **methods, "_jmp_lab_base": base,
      "_jmp_lab_dtypes": (compute, output)})


def _attend_method(base: type, compute: np.dtype, output: np.dtype,
                   reduced: Optional[tuple[np.dtype, np.dtype]]) -> Callable:
  """``Embed.attend`` (the logits GEMM of tied embeddings) under the rules,
  as ``__call__``."""
  gemm_dtype = compute if reduced is None else reduced[0]

  def attend(self, query, *args, **kwargs):
    if not is_tracing():
      return _under_rules(self, "attend", gemm_dtype, (query, *args), kwargs)
    with policy_cast_scope():
      query = cast_floating(query, gemm_dtype)
    with autocast_scope(gemm_dtype), _MODULE_CALLS.enter():
      if reduced is not None and base.attend is nnx.Embed.attend:
        out = reduce_lib.embed_attend(query, self.embedding.get_raw_value(),
                                      *reduced)
      else:
        out = base.attend(self, query, *args, **kwargs)
    with policy_cast_scope():
      return _cast_arrays(out, output)

  return attend


@contextlib.contextmanager
def _swapped(module: nnx.Module, attribute: str, value: Any):
  default = getattr(module, attribute)
  object.__setattr__(module, attribute, value)
  try:
    yield
  finally:
    object.__setattr__(module, attribute, default)


def _base_class(module: nnx.Module) -> type:
  return getattr(type(module), "_jmp_lab_base", type(module))


# Modules whose matmul or convolution is an attribute (see jmp_lab.reduce).
_REDUCIBLE_MODULES = (
    (nnx.Linear, "dot_general", jax.lax.dot_general, reduce_lib.dot_general),
    (nnx.LinearGeneral, "dot_general", jax.lax.dot_general,
     reduce_lib.dot_general),
    (nnx.Conv, "conv_general_dilated", jax.lax.conv_general_dilated,
     reduce_lib.conv_general_dilated),
    (nnx.Einsum, "einsum_op", jnp.einsum, reduce_lib.einsum),
)


_INSTALLED: set = set()  # the reduce-dtype functions with_policy gave out


@functools.lru_cache(maxsize=None)
def _reduced(factory: Callable[[Any], Callable], dtype: np.dtype) -> Callable:
  # One function object per dtype: it is a static attribute of the module,
  # part of the graph definition that nnx.jit caches compilations on.
  fn = factory(dtype)
  _INSTALLED.add(fn)
  return fn


def _runs_flax_matmul(module: nnx.Module, attribute: str, default) -> bool:
  """Whether ``module`` runs flax's own matmul: its attribute is flax's
  default, or None with no ``*_cls`` twin set (``nnx.LinearGeneral``, and so
  ``nnx.MultiHeadAttention``'s projections, default to None, which means
  ``lax.dot_general``)."""
  value = getattr(module, attribute)
  if value is None:
    return getattr(module, attribute + "_cls", None) is None
  return value is default


def _set_reduce_dtype(module: nnx.Module, reduce_dtype) -> None:
  """Gives a Linear/LinearGeneral/Conv the reduce dtype's matmul (or takes
  back what an earlier policy gave it); a module's own function is kept."""
  for cls, attribute, default, factory in _REDUCIBLE_MODULES:
    if _base_class(module) is cls:
      if getattr(module, attribute) in _INSTALLED:
        setattr(module, attribute, default)
      if reduce_dtype is not None and _runs_flax_matmul(module, attribute,
                                                        default):
        setattr(module, attribute, _reduced(factory, np.dtype(reduce_dtype)))
      return


# Modules whose matmul can run in fp8: (class, its matmul attribute, the
# default, the current-scaling version, the delayed-scaling factory).
_FP8_MODULES = (
    (nnx.Linear, "dot_general", jax.lax.dot_general, fp8.current_dot_general,
     fp8.delayed_dot_general),
    (nnx.LinearGeneral, "dot_general", jax.lax.dot_general,
     fp8.current_dot_general, fp8.delayed_dot_general),
    (nnx.Einsum, "einsum_op", jnp.einsum, fp8.current_einsum,
     fp8.delayed_einsum),
)


def _fp8_bias_inside(module: nnx.Module) -> bool:
  """Whether a delayed-scaling fp8 layer's bias is added inside its fp8
  product (:func:`jmp_lab.fp8.dot_general`): a Linear, or a LinearGeneral
  without batch axes, that has a bias. There the GEMM adds it (cuBLASLt's
  bias epilogue) and the kernel that quantizes the output gradient sums
  its gradient in fp32, in the same pass; flax's own add left XLA to read
  that gradient once more (and a LinearGeneral's multi-axis bias to be
  broadcast into a full matrix first)."""
  base = _base_class(module)
  return (base in (nnx.Linear, nnx.LinearGeneral)
          and getattr(module, "bias", None) is not None
          and not getattr(module, "batch_axis", None))


def _fp8_entry(module: nnx.Module) -> Optional[tuple]:
  return next((entry for entry in _FP8_MODULES
               if _base_class(module) is entry[0]), None)


def _fp8_mode(module: nnx.Module, policy: Policy) -> Optional[str]:
  """The module's fp8 matmul mode: the policy's for a Linear,
  LinearGeneral or Einsum that keeps flax's matmul (or jmp_lab's
  current-scaling one), else None."""
  entry = _fp8_entry(module)
  if policy.matmul is None or entry is None:
    return None
  _, attribute, default, current, _ = entry
  if not (_runs_flax_matmul(module, attribute, default)
          or getattr(module, attribute) is current):
    return None
  return policy.matmul


def _set_fp8_state(module: nnx.Module, mode: Optional[str],
                   history_length: int) -> None:
  """Gives a Linear/LinearGeneral/Einsum what its fp8 mode needs (and takes
  back what an earlier policy gave it): the current-scaling matmul, or an
  :class:`Fp8Meta`."""
  entry = _fp8_entry(module)
  if entry is None:
    return
  _, attribute, default, current, _ = entry
  if getattr(module, attribute) is current:
    setattr(module, attribute, default)
  if mode == "fp8_current":
    setattr(module, attribute, current)
  has_meta = isinstance(getattr(module, "fp8_meta", None), Fp8Meta)
  if mode == "fp8" and not has_meta:
    # One state per layer of a stack (layers built under nnx.vmap, run
    # under nnx.scan): its leading axes are the kernel's stacking axes.
    layers = _stacking_shape(module)
    module.fp8_meta = Fp8Meta(jax.tree_util.tree_map(
        lambda v: jnp.broadcast_to(v, layers + v.shape),
        fp8.init_meta(history_length)))
  elif mode != "fp8" and has_meta:
    del module.fp8_meta


def _stacking_shape(module: nnx.Module) -> tuple[int, ...]:
  """The leading axes by which ``module``'s kernel is stacked (``()`` for
  a layer built alone; ``(L,)`` for L layers built under ``nnx.vmap``)."""
  if isinstance(module, nnx.Einsum):
    own = len(module.kernel_shape)
  elif isinstance(module, nnx.LinearGeneral):
    own = (len(module.batch_axis) + len(module.in_features)
           + len(module.out_features))
  else:
    own = 2
  shape = jnp.shape(module.kernel.get_raw_value())
  return tuple(shape[:len(shape) - own])


def with_policy(
    model: nnx.Module,
    policy: PolicySpec,
    *,
    class_overrides: Optional[Mapping[type, PolicySpec]] = None,
    path_overrides: Optional[Mapping[str, PolicySpec]] = None,
    fp32_norms: bool = True,
    fp8_history_length: int = fp8.AMAX_HISTORY_LENGTH,
    keep_layer_dtypes: bool = False,
) -> nnx.Module:
  """Applies ``policy`` to an NNX module graph, in place; returns ``model``.

  Args:
    model: a constructed ``flax.nnx.Module``; its code is not changed.
    policy: the default policy (or its spec).
    class_overrides: ``{ModuleClass: policy}``; a module of that class and
      all modules inside it use that policy. Added to (and taking precedence
      over) the fp32 norm defaults.
    path_overrides: ``{regex: policy}`` matched with ``re.search`` against
      module paths (``"blocks/0/mlp"``) and param paths
      (``"blocks/0/mlp/kernel"``); these take precedence over classes.
    fp32_norms: compute norms in fp32 (:func:`jmp_lab.linen.fp32_island`):
      flax's LayerNorm, RMSNorm, BatchNorm and GroupNorm, and every module
      whose class name ends in ``Norm`` (a model's own ``RMSNorm``; flax's
      ``WeightNorm`` and ``SpectralNorm`` excepted). A class override takes
      a norm class back.
    fp8_history_length: the amax history of delayed fp8 scaling.
    keep_layer_dtypes: a layer that sets its own ``dtype`` computes in it.
      By default the policy wins over a layer's ``dtype`` (public model
      code passes ``dtype=jnp.float32`` to every layer); give an fp32 head
      a path or class override instead.

  **How precision is decided:** as in :func:`jmp_lab.linen.with_policy`,
  per module (policy, overrides) and per op: every module call runs under
  :func:`jmp_lab.autocast`'s rules in its compute dtype, so Flax's layers
  with ``dtype=jnp.float32``, ``Embed.attend`` and your own modules'
  matmuls all run in the compute dtype, and their exp, log and reductions
  in fp32.

  With ``matmul="fp8"`` (``"mixed_fp8"``) in ``policy``, every Linear and
  LinearGeneral (so the attention projections too) runs its matmul as an
  fp8 GEMM (:mod:`jmp_lab.fp8`) and gets an ``fp8_meta``
  (:class:`Fp8Meta`) variable with its scaling state; ``"fp8_current"``
  needs no state. An override without ``matmul`` keeps a module in the
  compute dtype.

  Calling it again on the same model replaces the policy.

  Raises:
    TypeError: if ``model`` is not an NNX Module or an override key is not a
      class.
    ValueError: for a bad policy spec or an invalid regular expression.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"jmp_lab.nnx.with_policy needs a flax.nnx.Module, got "
        f"{type(model).__name__}; for linen modules use "
        f"jmp_lab.linen.with_policy")
  policy = get_policy(policy)
  if not isinstance(fp8_history_length, int) or fp8_history_length < 1:
    raise ValueError(f"fp8_history_length must be a positive int, got "
                     f"{fp8_history_length!r}")
  for name, flag in (("fp32_norms", fp32_norms),
                     ("keep_layer_dtypes", keep_layer_dtypes)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  defaults: dict[type, Policy] = {}
  if fp32_norms:
    defaults.update((cls, fp32_island(policy)) for cls in DEFAULT_FP32_MODULES)
  if policy.reduce_dtype is not None:
    defaults[nnx.Embed] = reduce_island(policy)
  classes, patterns = resolve_overrides(class_overrides, path_overrides,
                                        defaults)
  modules = dict(nnx.iter_modules(model))

  def override_of(path: tuple) -> Optional[Policy]:
    """The override of the module at ``path`` or its nearest overridden
    parent (path patterns before classes, as in jmp_lab.linen)."""
    for end in range(len(path), -1, -1):
      prefix = path[:end]
      joined = "/".join(map(str, prefix))
      for pattern, override in patterns:
        if joined and pattern.search(joined):
          return override
      if prefix in modules:
        base = _base_class(modules[prefix])
        for cls, override in classes:
          if issubclass(base, cls):
            return override
        if fp32_norms and is_norm_class(base):
          return fp32_island(policy)
        if keep_layer_dtypes and layer_dtype(modules[prefix]) is not None:
          return layer_island(policy, layer_dtype(modules[prefix]))
    return None

  effective: dict[tuple, Policy] = {}
  for path, module in modules.items():
    override = override_of(path)
    effective[path] = override or policy
    compute = (override or policy).compute_dtype
    if override is not None:
      output = override.output_dtype
    elif path == ():
      output = policy.output_dtype
    else:
      output = policy.compute_dtype
    _set_reduce_dtype(module, None)  # what an earlier policy gave, back
    fp8_mode = _fp8_mode(module, effective[path])
    _set_fp8_state(module, fp8_mode, fp8_history_length)
    attend = None
    if (isinstance(module, nnx.Embed)
        and effective[path].reduce_dtype is not None):
      attend = (policy.compute_dtype, effective[path].reduce_dtype)
    module.__class__ = _policy_class(
        _base_class(module), compute, output, fp8_mode == "fp8",
        _reduced_bias(module, effective[path]), attend)
    if (isinstance(module, nnx.MultiHeadAttention)
        and module.attention_fn is nnx.dot_product_attention):
      module.attention_fn = dot_product_attention
    if fp8_mode is None:  # fp8 wins: its weight gradient is the fp8 GEMM's
      _set_reduce_dtype(module, effective[path].reduce_dtype)

  for path, variable in nnx.iter_graph(model):
    if not isinstance(variable, nnx.Param):
      continue
    joined = "/".join(map(str, path))
    read_policy = next((p for pattern, p in patterns if pattern.search(joined)),
                       None)
    if read_policy is None:  # the longest module path that owns it decides
      owner = next(path[:end] for end in range(len(path) - 1, -1, -1)
                   if path[:end] in modules)
      read_policy = effective[owner]
    value = variable.get_raw_value()
    if _tree.is_floating_array(value):
      variable.set_raw_value(value.astype(policy.param_dtype),
                             _unsafe_bypass_check=True)
    variable.__class__ = _cast_on_read_class(type(variable))
    variable.set_metadata(compute_dtype=read_policy.compute_dtype)
  return model


def policy_dtypes(module: nnx.Module) -> Optional[tuple[np.dtype, np.dtype]]:
  """``(compute_dtype, output_dtype)`` that :func:`with_policy` gave
  ``module``'s calls, or None when it has no policy."""
  return getattr(type(module), "_jmp_lab_dtypes", None)


# ---------------------------------------------------------------------------
# fp32 softmax attention (the helpers for logits are jmp_lab.linen's).
# ---------------------------------------------------------------------------


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None,
                          promote_dtype=None, is_causal: bool = False, *,
                          causal: bool = False, segment_ids=None,
                          implementation: str = "auto"):
  """``nnx.dot_product_attention`` with the softmax in fp32.

  With ``causal=True`` (or flax's ``is_causal``) or ``segment_ids`` and no
  mask, bias, dropout or sown weights, it runs
  :func:`jmp_lab.attention.dot_product_attention`: a fused kernel on CUDA
  (fp32 softmax statistics, no stored scores) and the materialized path
  elsewhere, in the compute dtype of the policy around it. Otherwise the
  scores are materialized: the two matmuls (and their gradients) run in the
  inputs' dtype, and the mask, softmax and dropout are fp32, like linen's
  ``force_fp32_for_softmax``. The weights are cast back for the second
  matmul. Flax's own computes the softmax in the input dtype.
  :func:`with_policy` gives it to every ``nnx.MultiHeadAttention`` that uses
  Flax's default. ``promote_dtype`` is accepted and unused (the policy has
  cast the inputs).

  Example::

    >>> import functools, jmp_lab
    >>> from flax import nnx
    >>> attention = nnx.MultiHeadAttention(
    ...     num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
    ...     attention_fn=functools.partial(jmp_lab.nnx.dot_product_attention,
    ...                                    causal=True))  # call it without a mask
  """
  del promote_dtype
  causal = causal or is_causal
  if (mask is None and bias is None and module is None
      and (deterministic or dropout_rate == 0.0)
      and (causal or segment_ids is not None)):
    half = kernel_dtype(dtype, query)
    query, key, value = (x.astype(half) for x in (query, key, value))
    return attention_lib.dot_product_attention(
        query, key, value, causal=causal, segment_ids=segment_ids,
        implementation=implementation)
  if query.shape[-2] != key.shape[-2]:
    raise ValueError(
        f"jmp_lab.nnx.dot_product_attention: query has {query.shape[-2]} "
        f"heads and key {key.shape[-2]}; grouped-query attention is not "
        f"supported")
  dtype = np.dtype(query.dtype if dtype is None else dtype)
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  query = query / jnp.asarray(math.sqrt(query.shape[-1]), dtype)
  # The logits leave the matmul in its dtype (tensor cores accumulate in
  # fp32 anyway) and are cast after: an fp32 result would make both of its
  # gradient matmuls fp32-by-half, off the half tensor-core path.
  logits = jnp.einsum("...qhd,...khd->...hqk", query, key,
                      precision=precision).astype(jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  mask = attention_lib.combined_mask(mask, query, key, causal, segment_ids)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)
  if module is not None:
    module.sow(nnx.Intermediate, "attention_weights", weights)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = ((1,) * (weights.ndim - 2) + weights.shape[-2:]
             if broadcast_dropout else weights.shape)
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * keep.astype(jnp.float32) / keep_prob
  return jnp.einsum("...hqk,...khd->...qhd", weights.astype(dtype), value,
                    precision=precision)


# ---------------------------------------------------------------------------
# The optimizer.
# ---------------------------------------------------------------------------


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for a jmp_lab optimizer: master, loss scale, skips.

  ``tx`` is :func:`jmp_lab.mixed_precision` (any optax transformation
  inside, every ``master`` mode) or :func:`jmp_lab.fused_adamw` (tree
  layout). ``update(model, grads)`` takes the gradients of the *scaled*
  loss (:attr:`loss_scale`; :func:`train_step` does the scaling) and writes
  params equal to ``cast(master)``. A non-finite step changes nothing but
  the loss scale and :attr:`skipped_steps`: params, moments and ``step``
  (applied steps) keep their values.

  Example::

    >>> import jax.numpy as jnp, optax, jmp_lab
    >>> from flax import nnx
    >>> model = jmp_lab.nnx.with_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
    ...                                 "p=bf16,c=bf16,o=f32")
    >>> optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.fused_adamw(
    ...     1e-3, policy="p=bf16,c=bf16,o=f32",
    ...     loss_scale=jmp_lab.StaticLossScale(2.0**10)), wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: optimizer.loss_scale.scale(m(jnp.ones((1, 2))).sum()))(model)
    >>> optimizer.update(model, grads)
    >>> master = optimizer.master_params(model)
    >>> bool(jnp.all(model.kernel.get_raw_value() == master["kernel"].astype(jnp.bfloat16)))
    True
  """

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *,
               wrt: Any = nnx.Param):
    _checks.check_transformation(tx, "jmp_lab.nnx.Optimizer's tx")
    if not isinstance(model, nnx.Module):
      raise TypeError(f"jmp_lab.nnx.Optimizer needs a flax.nnx.Module, got "
                      f"{type(model).__name__}")
    params = _pure_params(model, wrt)
    if not jax.tree_util.tree_leaves(params):
      raise ValueError(
          f"jmp_lab.nnx.Optimizer's wrt={wrt!r} selects no variable of the "
          f"{type(model).__name__}: nothing would be trained. Give the "
          f"filter of its params (nnx.Param, the default)")
    opt_state = tx.init(params)
    try:
      state = find_state(opt_state)
    except ValueError:
      raise TypeError(
          "jmp_lab.nnx.Optimizer's tx must be a jmp_lab optimizer "
          "(jmp_lab.mixed_precision(...) or jmp_lab.fused_adamw(...)), which "
          "keeps the master, the loss scale and skips non-finite steps; got "
          f"one whose state is a {type(opt_state).__name__}") from None
    if isinstance(state, FusedAdamWState) and isinstance(
        state.layout, flat_layout.FlatLayout):
      raise ValueError(
          "jmp_lab.nnx.Optimizer needs fused_adamw's tree layout (the NNX "
          "model owns its params as a tree); got layout='flat'")
    _check_model_agrees(model, _checks.optimizer_policy(tx))
    self.graph = None
    self.step = nnx.training.optimizer.OptState(jnp.zeros((), jnp.uint32))
    self.tx = tx
    self.wrt = wrt
    self.opt_state = nnx.data(nnx.training.optimizer.to_opt_state(opt_state))

  def _pure_opt_state(self) -> Any:
    return nnx.as_pure(self.opt_state)

  @property
  def loss_scale(self) -> LossScale:
    """The loss scale for the next forward pass."""
    return current_loss_scale(self._pure_opt_state())

  @property
  def skipped_steps(self) -> jax.Array:
    return skipped_steps(self._pure_opt_state())

  @property
  def last_step_applied(self) -> jax.Array:
    return last_step_applied(self._pure_opt_state())

  def master_params(self, model: nnx.Module) -> Any:
    """The fp32 master as a pure ``nnx.State`` dict tree (None where no
    master is kept: fp32 params, ``master="none"``)."""
    return master_params(self._pure_opt_state(), _pure_params(model, self.wrt))

  def update(self, model: nnx.Module, grads: Any, /, **kwargs) -> None:
    """Applies the gradients of the *scaled* loss to ``model``'s params."""
    params = _pure_params(model, self.wrt)
    grads = nnx.as_pure(nnx.state(grads, self.wrt)) if isinstance(
        grads, nnx.State) else grads
    _checks.check_grads(grads, params)
    opt_state = self._pure_opt_state()
    with jax.named_scope(UPDATE_SCOPE):
      new_params_fn = getattr(self.tx.update, "new_params", None)
      if new_params_fn is not None and not kwargs:
        new_params, new_opt_state = new_params_fn(grads, opt_state, params)
      else:
        updates, new_opt_state = self.tx.update(grads, opt_state, params,
                                                **kwargs)
        new_params = optax.apply_updates(params, updates)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(
        nnx.training.optimizer.to_opt_state(new_opt_state)))
    self.step[...] += last_step_applied(new_opt_state).astype(jnp.uint32)


def _check_model_agrees(model: nnx.Module, policy: Optional[Policy]) -> None:
  """Refuses an optimizer whose policy computes in another dtype than the
  model's (``with_policy``), naming both."""
  dtypes = policy_dtypes(model)
  if policy is None or dtypes is None or dtypes[0] == policy.compute_dtype:
    return
  raise ValueError(
      f"jmp_lab.nnx.Optimizer: the model computes in {dtypes[0].name} "
      f"(jmp_lab.nnx.with_policy) but the optimizer's policy ({policy}) "
      f"computes in {policy.compute_dtype.name}; give both the same policy")


def _pure_params(model: nnx.Module, wrt: Any) -> Any:
  """The stored (not cast-on-read) values of ``model``'s ``wrt`` variables."""
  return nnx.as_pure(nnx.state(model, wrt))


# ---------------------------------------------------------------------------
# The train step.
# ---------------------------------------------------------------------------

LossFn = Callable[[nnx.Module, Any], Any]

_LOSS_FN_CONTRACT = (
    "loss_fn(model, batch) must return a floating scalar loss, or "
    "(loss, metrics) with metrics a dict")


def _split_loss_output(out: Any) -> tuple[Any, dict[str, Any]]:
  if isinstance(out, tuple) and len(out) != 2:
    raise TypeError(f"{_LOSS_FN_CONTRACT}; got a tuple of {len(out)} items")
  loss, metrics = out if isinstance(out, tuple) else (out, None)
  _checks.check_loss(loss, _LOSS_FN_CONTRACT)
  return loss, _checks.checked_metrics(metrics, _LOSS_FN_CONTRACT)


def train_step(model: nnx.Module, optimizer: Optimizer, batch: Any, *,
               loss_fn: LossFn) -> dict[str, Any]:
  """One mixed-precision step on ``model``, in place; returns the metrics.

  ``loss_fn(model, batch)`` runs the forward pass and returns the loss, or
  ``(loss, metrics)``. The loss times the optimizer's loss scale is
  differentiated with respect to the optimizer's ``wrt`` variables; the
  optimizer unscales, checks, updates or skips. On a skipped step the
  model's other state (batch statistics, RNG counts) is put back as it was,
  so a skipped step changes nothing but the loss scale.

  Returns:
    ``loss``, the ``loss_scale`` used, ``grads_finite``, ``skipped_steps``
    and the loss_fn's own metrics (the linen step's metrics).
  """
  if not isinstance(optimizer, Optimizer):
    got = ("flax.nnx.Optimizer (Flax's own, which keeps no fp32 master, "
           "loss scale or skipped steps)" if isinstance(optimizer, nnx.Optimizer)
           else type(optimizer).__name__)
    raise TypeError(
        f"optimizer must be a jmp_lab.nnx.Optimizer, got {got}; build "
        f"jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(optax.adamw"
        f"(...), policy=...), wrt=nnx.Param)")
  others = nnx.Not(optimizer.wrt)
  before = nnx.as_pure(nnx.state(model, others))  # arrays: a snapshot
  loss_scale = optimizer.loss_scale

  def forward(model):
    return _split_loss_output(loss_fn(model, batch))

  # The fp8 scaling state is differentiated too: its gradient is what the
  # step observed (each tensor's amax), from which fp8.next_meta computes
  # the new state; it never reaches the optimizer.
  with recording() as matmuls:
    (loss, metrics), grads = scaled_value_and_grad(
        forward, loss_scale, has_aux=True, value_and_grad=nnx.value_and_grad,
        argnums=nnx.DiffState(0, nnx.Any(optimizer.wrt, Fp8Meta)))(model)
  policy = _checks.optimizer_policy(optimizer.tx)
  if policy is not None:
    warn_unless_half(policy, matmuls, lambda: _loss_jaxpr(loss_fn, model,
                                                          batch),
                     "jmp_lab.nnx.train_step")
  scaled_grads, fp8_observed = nnx.split_state(grads, optimizer.wrt, ...)
  if fp8_observed:
    scaled_grads = fp8.skip_unless_finite(scaled_grads, fp8_observed)
  steps_before = optimizer.step[...]  # where next_meta writes the amaxes
  optimizer.update(model, scaled_grads)
  applied = optimizer.last_step_applied
  after = nnx.as_pure(nnx.state(model, others))
  nnx.update(model, select_tree(applied, after, before))
  if fp8_observed:  # kept on a skipped step, like everything else
    # Leaf by leaf: the gradient state nests each Fp8Meta's dict value
    # differently from nnx.state, in the same (sorted) order.
    treedef = jax.tree_util.tree_structure(fp8_observed)
    old = treedef.unflatten(jax.tree_util.tree_leaves(
        nnx.state(model, Fp8Meta)))
    # next_meta in two halves, the scales from the kept histories (see
    # fp8.write_amaxes).
    written = fp8.write_amaxes(old, fp8_observed, steps_before)
    kept = treedef.unflatten(select_tree(
        applied, jax.tree_util.tree_leaves(written),
        jax.tree_util.tree_leaves(old)))
    nnx.update(model, fp8.rescale(kept, applied))
  metrics.update(loss=loss, loss_scale=loss_scale.loss_scale,
                 grads_finite=applied, skipped_steps=optimizer.skipped_steps)
  return metrics


def _loss_jaxpr(loss_fn: LossFn, model: nnx.Module, batch: Any):
  """The jaxpr of ``loss_fn`` on a copy of ``model`` (its state updates,
  such as batch statistics, are dropped)."""
  graphdef, state = nnx.split(model)
  return jax.make_jaxpr(
      lambda state: loss_fn(nnx.merge(graphdef, state), batch))(state)


def make_train_step(loss_fn: LossFn, *, donate: bool = True
                    ) -> Callable[[nnx.Module, Optimizer, Any], dict]:
  """``nnx.jit(train_step)`` for ``loss_fn``; with ``donate=True`` the old
  params, master and moments' buffers are reused for the new ones."""
  return nnx.jit(functools.partial(train_step, loss_fn=loss_fn),
                 donate_argnums=(0, 1) if donate else ())


def split_train_step(loss_fn: LossFn, model: nnx.Module, optimizer: Optimizer
                     ) -> tuple[Callable[[Any, Any], tuple[Any, dict]], Any]:
  """:func:`train_step` as a pure function of the split state.

  Returns ``(step, state)``: ``step(state, batch) -> (new_state, metrics)``
  for ``jax.jit``, :func:`jmp_lab.diagnostics.audit_step` and
  :func:`jmp_lab.diagnostics.compiled_report`, and the model's and
  optimizer's ``state``; ``nnx.update((model, optimizer), new_state)`` puts
  a step's result back into the objects.
  """
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = train_step(model, optimizer, batch, loss_fn=loss_fn)
    return nnx.state((model, optimizer)), metrics

  return step, state


__all__ = [
    "DEFAULT_FP32_MODULES", "Fp8Meta", "Optimizer", "PolicyParam", "dot_product_attention",
    "log_softmax", "make_train_step", "policy_dtypes", "softmax",
    "softmax_cross_entropy_with_integer_labels", "split_train_step",
    "train_step", "with_policy",
]
