"""Precision policies for Flax linen modules, without touching module code.

:func:`with_policy` wraps any linen module. Its ``init``/``apply`` mirror
linen's functional API, and inside ``apply`` every module call is intercepted
(``flax.linen.intercept_methods``):

* floating inputs are cast to the module's compute dtype;
* the module's params are cast to its compute dtype before it reads them;
* outputs are cast to the compute dtype (the top-level module's outputs to the
  policy's ``output_dtype``).

Overrides give a module (and everything inside it) another policy, chosen by
class or by a regular expression over its path (``"Block_0/Dense_1"``); a path
pattern also matches single params (``"head/kernel"``). By default the
normalisation layers (LayerNorm, RMSNorm, BatchNorm, GroupNorm) compute in
fp32 and hand back the compute dtype; BatchNorm's ``batch_stats`` stay fp32.
Only the ``params`` collection is ever cast.

A policy with a ``reduce`` dtype (``"mixed_bfloat16,reduce=float32"``) has
the gradients summed across devices in it: ``nn.Dense`` and
``nn.DenseGeneral`` (and so flax's attention projections) get
:func:`jmp_lab.reduce.dot_general` as their ``dot_general``, ``nn.Conv``
:func:`jmp_lab.reduce.conv_general_dilated` (unless they set their own),
``nn.Embed`` looks its rows up in the reduce dtype, so the table's gradient
is accumulated in it, and ``nn.Einsum``'s kernel and every bias (of those
layers and of ``nn.ConvTranspose`` and ``nn.ConvLocal``) are read through
``stop_gradient`` and get their gradient attached after the call, summed in
the reduce dtype (:func:`jmp_lab.reduce.with_param_gradient`). Norms are fp32
islands already. Not covered (a warning says so): the kernels of
``nn.ConvTranspose`` and ``nn.ConvLocal``, and the attached params of layers
inside ``nn.scan`` or ``nn.vmap``, which stack them (a Dense's kernel there
is covered: its gradient GEMM is inside the layer's call).

Softmax and cross-entropy stay fp32 through the helpers here:
:func:`softmax`, :func:`softmax_cross_entropy_with_integer_labels`, and
:data:`dot_product_attention` (pass it as ``attention_fn`` to
``nn.MultiHeadDotProductAttention``).

Example::

  >>> import flax.linen as nn, jax, jax.numpy as jnp, jmp_lab
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.Dense(4)(nn.LayerNorm()(nn.Dense(8)(x)))
  >>> model = jmp_lab.linen.with_policy(MLP(), "mixed_bfloat16")
  >>> x = jnp.ones((2, 3))
  >>> variables = model.init(jax.random.key(0), x)   # params in param_dtype
  >>> variables["params"]["Dense_0"]["kernel"].dtype
  dtype('float32')
  >>> model.apply(variables, x).dtype                # bf16 inside, f32 out
  dtype('float32')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
from typing import Any, Mapping, Optional, Union

import flax
import flax.linen as nn
from flax import traverse_util
from flax.linen.dtypes import promote_dtype as flax_promote_dtype
from flax.linen.module import merge_param
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lab import attention as attention_lib
from jmp_lab import fp8, losses
from jmp_lab import reduce as reduce_lib
from jmp_lab.autocast import (apply_rules, current_compute_dtype, make_rules,
                              policy_cast_scope)
from jmp_lab.autocast import scope as autocast_scope
from jmp_lab.policy import (Policy, cast_floating, get_policy,
                            is_norm_class, layer_dtype, resolve_overrides)

DEFAULT_FP32_MODULES: tuple[type, ...] = (
    nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm)

PolicySpec = Union[Policy, str]


def fp32_island(policy: Policy) -> Policy:
  """The policy of an fp32 island (e.g. a norm) inside ``policy``.

  It keeps params in ``policy.param_dtype``, computes in fp32 and hands its
  output back in ``policy.compute_dtype``, so the half-precision activations
  around it stay half precision.
  """
  return Policy(policy.param_dtype, jnp.float32, policy.compute_dtype,
                policy.reduce_dtype)


def layer_island(policy: Policy, dtype: Any) -> Policy:
  """The policy of a layer that keeps its own ``dtype`` (``with_policy(...,
  keep_layer_dtypes=True)``): it computes in ``dtype`` and hands its output
  back in the compute dtype."""
  return Policy(policy.param_dtype, dtype, policy.compute_dtype,
                policy.reduce_dtype)


def reduce_island(policy: Policy) -> Policy:
  """The policy of an embedding under a policy with a reduce dtype: the table
  is read in the reduce dtype (its gradient, a scatter-add of rows, is
  accumulated and summed across devices in it) and the rows are handed on
  in the compute dtype."""
  return Policy(policy.param_dtype, policy.reduce_dtype, policy.compute_dtype,
                policy.reduce_dtype)


# Modules whose matmul or convolution is an attribute (see jmp_lab.reduce):
# (class, attribute, its _cls twin, the reduce-dtype version's factory).
_REDUCIBLE_MODULES = (
    (nn.Dense, "dot_general", "dot_general_cls", reduce_lib.dot_general),
    (nn.DenseGeneral, "dot_general", "dot_general_cls", reduce_lib.dot_general),
    (nn.Conv, "conv_general_dilated", "conv_general_dilated_cls",
     reduce_lib.conv_general_dilated),
)
# Modules whose weight gradient a reduce dtype does not reach yet (their
# biases it does).
_NOT_REDUCED_MODULES = (nn.ConvTranspose, nn.ConvLocal)
# Modules that add their bias broadcast over their output's leading axes
# (nn.Einsum: over the axes its equation says).
_BIAS_MODULES = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose,
                 nn.ConvLocal, nn.Einsum)


@dataclasses.dataclass(frozen=True)
class PolicyModule:
  """A linen module with a precision policy; see :func:`with_policy`."""

  module: nn.Module
  policy: Policy
  class_overrides: tuple[tuple[type, Policy], ...]
  path_overrides: tuple[tuple[re.Pattern, Policy], ...]
  fp8_history_length: int = fp8.AMAX_HISTORY_LENGTH
  # The fp32 island of a module whose class name ends in "Norm" (None:
  # fp32_norms=False).
  norm_island: Optional[Policy] = None
  keep_layer_dtypes: bool = False
  # Which module owns which param depends only on the shapes of what goes
  # in, so the abstract trace is memoized on them (see _module_policies).
  _traced: dict = dataclasses.field(default_factory=dict, compare=False,
                                    repr=False)

  # ---- which policy applies where ------------------------------------------

  def module_policy(self, module: nn.Module) -> Optional[Policy]:
    """The override for ``module`` itself or its nearest overridden parent:
    a path pattern, a class, a norm by its class name, or (with
    ``keep_layer_dtypes``) the layer's own ``dtype``."""
    while isinstance(module, nn.Module):
      path = "/".join(module.path)
      for pattern, policy in self.path_overrides:
        if path and pattern.search(path):
          return policy
      for cls, policy in self.class_overrides:
        if isinstance(module, cls):
          return policy
      if self.norm_island is not None and is_norm_class(type(module)):
        return self.norm_island
      if self.keep_layer_dtypes and layer_dtype(module) is not None:
        return layer_island(self.policy, layer_dtype(module))
      module = module.parent
    return None

  def _param_policies(self, params: Any, module_policies: Mapping[tuple, Policy]
                      ) -> Any:
    """For every param leaf, the policy whose compute dtype it is cast to."""

    def for_leaf(path, _):
      names = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)
      joined = "/".join(str(n) for n in names)
      for pattern, policy in self.path_overrides:
        if pattern.search(joined):
          return policy
      # The longest module path that owns this param decides.
      for end in range(len(names) - 1, -1, -1):
        if names[:end] in module_policies:
          return module_policies[names[:end]]
      return self.policy

    return jax.tree_util.tree_map_with_path(for_leaf, params)

  # ---- linen's functional API ---------------------------------------------

  def init(self, rngs, *args, method=None, **kwargs) -> dict:
    """``module.init`` with the params cast to ``policy.param_dtype``."""
    with nn.intercept_methods(self._interceptor({})):
      variables = self.module.init(rngs, *args, method=method, **kwargs)
    variables = dict(variables)
    if "params" in variables:
      variables["params"] = self.policy.cast_to_param(variables["params"])
    return variables

  def apply(self, variables: Mapping[str, Any], *args, rngs=None,
            mutable=False, method=None, **kwargs) -> Any:
    """``module.apply`` under the policy; same arguments and results."""
    variables = dict(variables)
    attached: dict[tuple, dict[str, jax.Array]] = {}
    if "params" in variables:
      module_policies, attach = self._module_policies(
          variables, args, kwargs, rngs=rngs, mutable=mutable, method=method)
      leaf_policies = self._param_policies(variables["params"],
                                           module_policies)
      variables["params"] = jax.tree_util.tree_map(
          lambda x, policy: cast_floating(x, policy.compute_dtype),
          variables["params"], leaf_policies,
          is_leaf=lambda x: isinstance(x, Policy))
      variables["params"] = _detach(variables["params"], attach, attached)
    # Every matmul under the rules (jmp_lab.autocast): the interceptor
    # marks each module call with its compute dtype, so a layer's own
    # dtype=float32 (or a custom module's fp32 code) cannot take its
    # matmuls out of the compute dtype.
    run = apply_rules(self.module.apply, make_rules(self.policy.compute_dtype))
    with nn.intercept_methods(self._interceptor(attached)):
      return run(variables, *args, rngs=rngs, mutable=mutable, method=method,
                 **kwargs)

  def __call__(self, variables, *args, **kwargs):
    return self.apply(variables, *args, **kwargs)

  # ---- interception ---------------------------------------------------------

  def _module_policies(self, variables, args, kwargs, **apply_kwargs
                       ) -> tuple[dict[tuple, Policy], dict[tuple, tuple]]:
    """:meth:`_trace_module_policies`, memoized on structure and shapes."""
    key = _abstract_key((variables, args, kwargs, apply_kwargs))
    if key is None:  # something unhashable went in: trace every time
      return self._trace_module_policies(variables, args, kwargs,
                                         **apply_kwargs)
    if key not in self._traced:
      if len(self._traced) >= _MAX_TRACED:
        self._traced.pop(next(iter(self._traced)))
      self._traced[key] = self._trace_module_policies(
          variables, args, kwargs, **apply_kwargs)
    return self._traced[key]

  def _trace_module_policies(self, variables, args, kwargs, **apply_kwargs
                             ) -> tuple[dict[tuple, Policy], dict[tuple, tuple]]:
    """Maps each overridden module's path to its policy, and each module
    whose param gradients jmp_lab attaches (:func:`_attached_params`) to
    those params' names, by an abstract trace.

    Which module owns which param is only known by running the model, so the
    model is traced once abstractly (``jax.eval_shape``: no FLOPs, no memory).
    """
    found: dict[tuple, Policy] = {}
    attach: dict[tuple, tuple] = {}
    model_params = traverse_util.flatten_dict(
        flax.core.unfreeze(variables.get("params", {})))

    # Each call runs as apply runs it (inputs and outputs cast to the
    # policy's dtypes), so code that checks dtypes (an explicit fused
    # kernel that takes only half precision) sees what apply gives it.
    as_applied = self._interceptor({})

    def record(next_fun, call_args, call_kwargs, context):
      policy = self.module_policy(context.module)
      path = tuple(context.module.path)
      if policy is not None:
        found[path] = policy
      names = _unstacked(context.module, _attached_params(
          context.module, policy or self.policy), model_params,
                         (policy or self.policy).reduce_dtype)
      if names:
        attach[path] = names
      return as_applied(next_fun, call_args, call_kwargs, context)

    def run(variables):
      with nn.intercept_methods(record):
        return self.module.apply(variables, *args, **apply_kwargs, **kwargs)

    jax.eval_shape(run, variables)
    return found, attach

  def _interceptor(self, attached: Mapping[tuple, Mapping[str, jax.Array]]):
    depth = [0]

    def intercept(next_fun, args, kwargs, context):
      name = context.method_name
      if name == "setup" or (name.startswith("_") and name != "__call__"):
        return next_fun(*args, **kwargs)
      is_top_level = depth[0] == 0
      override = self.module_policy(context.module)
      policy = override or self.policy
      compute = policy.compute_dtype
      if is_top_level and override is None:
        output = self.policy.output_dtype
      elif override is not None:
        output = override.output_dtype
      else:
        output = self.policy.compute_dtype
      with policy_cast_scope():
        args, kwargs = cast_floating((args, kwargs), compute)
      module = context.module
      depth[0] += 1
      try:
        if name == "attend" and _reduced_attend(module, policy):
          # The tied logits GEMM in the model's compute dtype, its table
          # gradient summed in the reduce dtype.
          with autocast_scope(self.policy.compute_dtype):
            out = reduce_lib.embed_attend(args[0], module.embedding,
                                          self.policy.compute_dtype,
                                          policy.reduce_dtype)
        elif name == "__call__" and _is_fp8_einsum(module, policy):
          with autocast_scope(compute):
            out = _fp8_einsum_call(module, args, kwargs, _einsum_fp8_meta(
                module, policy, self.fp8_history_length), compute)
        else:
          with autocast_scope(compute), _matmul_override(
              module, policy, self.fp8_history_length), \
              _fp32_softmax_attention(module):
            out = next_fun(*args, **kwargs)
      finally:
        depth[0] -= 1
      params = attached.get(tuple(module.path))
      if params and name == "__call__":
        out = _attach_gradients(module, out, params, args, kwargs,
                                policy.reduce_dtype)
      with policy_cast_scope():
        return cast_floating(out, output)

    return intercept


# ---- gradients attached after a layer's call (reduce dtype) -----------------
#
# Flax's layers add their bias in the compute dtype, so under data
# parallelism its gradient, the output gradient summed over the batch, is
# summed in it across devices too; nn.Einsum calls jnp.einsum with no
# matmul to inject. For those params the layer reads the (cast) param
# through stop_gradient and the interceptor attaches the gradient after the
# call with jmp_lab.reduce.with_param_gradient, summed in the reduce dtype.
# The forward pass is the layer's own.


def _runs_its_own_call(module: nn.Module, classes: tuple) -> bool:
  # A subclass that overrides __call__ may use its params otherwise.
  return any(isinstance(module, cls) and type(module).__call__ is cls.__call__
             for cls in classes)


def _attached_params(module: nn.Module, policy: Policy) -> tuple[str, ...]:
  """The params of ``module`` whose gradients the interceptor attaches: under
  a reduce dtype, every bias and an Einsum's kernel (not under fp8: its
  gradient comes out of the fp8 GEMM)."""
  if policy.reduce_dtype is None:
    return ()
  names = []
  if (_runs_its_own_call(module, (nn.Einsum,))
      and not _is_fp8_einsum(module, policy)):
    names.append("kernel")
  if (_runs_its_own_call(module, _BIAS_MODULES) and module.use_bias
      and not getattr(module, "batch_dims", ())
      and not _fp8_bias_inside(module, policy)):
    # (The fp8 product sums its bias gradient in fp32, across devices too.)
    names.append("bias")
  return tuple(names)


def _unstacked(module: nn.Module, names: tuple[str, ...],
               model_params: Mapping[tuple, Any], reduce_dtype
               ) -> tuple[str, ...]:
  """The ``names`` whose params ``module`` sees as the model holds them.

  A gradient is attached from the model's param, outside the module's call
  (:func:`_detach`); inside ``nn.scan`` or ``nn.vmap`` the module sees one
  slice of a stacked param, which that cannot reach. Those params keep
  flax's own gradient, summed in the compute dtype, and a warning says so
  (a ValueError deep in jax's transpose was what it said before).
  """
  inside = module.variables.get("params", {})
  path = tuple(module.path)
  kept = tuple(name for name in names if name in inside
               and path + (name,) in model_params
               and np.shape(inside[name]) == np.shape(
                   model_params[path + (name,)]))
  if kept != names:
    skipped = [name for name in names if name not in kept]
    warnings.warn(
        f"policy reduce dtype {np.dtype(reduce_dtype).name} does not reach "
        f"the {' and '.join(skipped)} of {type(module).__name__} "
        f"{'/'.join(module.path)!r}: its params are stacked by a lifted "
        f"transform (nn.scan, nn.vmap), so their gradients are summed across "
        f"devices in the compute dtype; its matmul's weight gradient, where "
        f"it has one, is in the reduce dtype", stacklevel=5)
  return kept


def _detach(params: Any, attach: Mapping[tuple, tuple],
            attached: dict) -> Any:
  """``params`` with the attached ones behind ``stop_gradient``; their
  differentiable values go into ``attached[module_path][name]``."""
  if not attach:
    return params
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  for path, names in attach.items():
    for name in names:
      if path + (name,) in flat:
        attached.setdefault(path, {})[name] = flat[path + (name,)]
        flat[path + (name,)] = jax.lax.stop_gradient(flat[path + (name,)])
  out = traverse_util.unflatten_dict(flat)
  return flax.core.freeze(out) if isinstance(params, flax.core.FrozenDict) else out


def _attach_gradients(module: nn.Module, out, params: Mapping[str, Any],
                      args, kwargs, reduce_dtype) -> Any:
  einsum = isinstance(module, nn.Einsum)
  if einsum:
    inputs, subscripts = reduce_lib.flax_einsum_call(module, args, kwargs)
    kernel = jax.ShapeDtypeStruct(tuple(module.shape), inputs.dtype)
  if "kernel" in params:
    # The input as flax's einsum saw it.
    inputs, _, _ = module.promote_dtype(inputs, params["kernel"], None,
                                        dtype=module.dtype)
    kernel_shape = params["kernel"].shape
    gradient = lambda g, x: reduce_lib.einsum_rhs_gradient(  # noqa: E731
        subscripts, x, g, kernel_shape, reduce_dtype)
    out = reduce_lib.with_param_gradient(
        gradient, out, params["kernel"], jax.lax.stop_gradient(inputs))
  if "bias" in params:
    broadcast = (reduce_lib.einsum_bias_broadcast(subscripts, inputs, kernel)
                 if einsum else params["bias"].shape)
    gradient = lambda g, _: reduce_lib.bias_gradient(  # noqa: E731
        g, broadcast, reduce_dtype)
    out = reduce_lib.with_param_gradient(gradient, out, params["bias"], ())
  return out


_MAX_TRACED = 32


class Fp8DotGeneral(nn.Module):
  """A delayed-scaling fp8 ``dot_general`` (:func:`jmp_lab.fp8.dot_general`)
  for ``nn.Dense``'s ``dot_general_cls``: its scales and amax histories are
  variables in the ``_overwrite_with_gradient`` collection
  (:data:`jmp_lab.fp8.COLLECTION`), which ``jmp_lab.train_step``
  differentiates and replaces with :func:`jmp_lab.fp8.next_meta` of their
  gradients (the amaxes the step observed)."""

  history_length: int = fp8.AMAX_HISTORY_LENGTH
  # Where the policy adds the layer's bias inside the fp8 product: a
  # function that returns the layer's bias param (see _fp8_bias_param).
  bias_param: Optional[Any] = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None):
    return fp8.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type,
        meta=_fp8_meta(self, self.history_length),
        bias=None if self.bias_param is None else self.bias_param())


def _fp8_meta(module: nn.Module, history_length: int) -> fp8.Fp8Meta:
  """``module``'s delayed-scaling state: variables in its own scope's
  :data:`jmp_lab.fp8.COLLECTION`, created by ``init``. A clear error where
  an ``apply`` has none (flax's says the collection is empty)."""
  initial = fp8.init_meta(history_length)
  if not module.is_mutable_collection(fp8.COLLECTION) and not all(
      module.has_variable(fp8.COLLECTION, name) for name in initial):
    where = ("init cannot create it" if module.is_initializing()
             else "this apply has none")
    raise ValueError(
        f"an fp8 policy keeps each fp8 matmul's scaling state in the "
        f"model's {fp8.COLLECTION!r} collection (jmp_lab.fp8.COLLECTION), "
        f"and {where} for {'/'.join(module.path)!r}. Pass every collection "
        f"init returned, not only 'params': model.apply({{'params': params, "
        f"**model_state}}, ...), as jmp_lab.TrainState.create(model_state="
        f"...) keeps them. A model that runs layers under nn.scan or nn.vmap "
        f"must list the collection there: nn.scan(..., variable_axes="
        f"{{'params': 0, jmp_lab.fp8.COLLECTION: 0}})")
  return {name: module.variable(fp8.COLLECTION, name, lambda v=v: v).value
          for name, v in initial.items()}


_FP8_MODULES = (nn.Dense, nn.DenseGeneral)


def _is_exactly(module: nn.Module, cls: type) -> bool:
  return type(module) is cls or (isinstance(module, cls) and not isinstance(
      module, _NOT_REDUCED_MODULES))


@contextlib.contextmanager
def _set_for_one_call(module: nn.Module, attribute: str, value: Any):
  # Flax modules are frozen dataclasses built inside the user's code, so
  # the attribute is set on the instance and restored afterwards.
  before = getattr(module, attribute)
  object.__setattr__(module, attribute, value)
  try:
    yield
  finally:
    object.__setattr__(module, attribute, before)


_ATTENTION_MODULES = (nn.MultiHeadDotProductAttention,)  # SelfAttention too


def _fp32_softmax_attention(module: nn.Module):
  """For one call: a flax attention module that uses flax's default
  ``attention_fn`` gets :data:`dot_product_attention` (fp32 softmax)."""
  if (isinstance(module, _ATTENTION_MODULES)
      and module.attention_fn is nn.dot_product_attention):
    return _set_for_one_call(module, "attention_fn", dot_product_attention)
  return contextlib.nullcontext()


def _reduced_attend(module: nn.Module, policy: Policy) -> bool:
  """``Embed.attend`` (flax's own) under a reduce dtype."""
  return (policy.reduce_dtype is not None and isinstance(module, nn.Embed)
          and type(module).attend is nn.Embed.attend)


@contextlib.contextmanager
def _matmul_override(module: nn.Module, policy: Policy, history_length: int):
  """For one call: a Dense/DenseGeneral's ``dot_general`` (or
  ``dot_general_cls``) in fp8 under a ``matmul`` policy, or the reduce
  dtype's under a ``reduce`` policy (fp8 wins: its weight gradient comes out
  of the fp8 GEMM); a module that sets its own keeps it. (An ``nn.Einsum``
  has no matmul attribute: under fp8 the interceptor runs
  :func:`_fp8_einsum_call` in its place.)
  """
  if policy.matmul is not None and any(_is_exactly(module, cls)
                                       for cls in _FP8_MODULES):
    if module.dot_general is not None or module.dot_general_cls is not None:
      override = contextlib.nullcontext()
    elif policy.matmul == "fp8_current":
      # In the compute dtype: a layer that pins float32 hands its matmul
      # fp32 operands, which compile to 16-bit GEMMs (the delayed mode's
      # Fp8DotGeneral is a module, whose inputs the interceptor casts).
      override = _set_for_one_call(module, "dot_general", fp8.operands_in(
          fp8.current_dot_general, policy.compute_dtype))
    elif _fp8_bias_inside(module, policy):
      override = contextlib.ExitStack()
      override.enter_context(_set_for_one_call(
          module, "dot_general_cls", functools.partial(
              Fp8DotGeneral, history_length=history_length,
              bias_param=functools.partial(_fp8_bias_param, module))))
      # flax's call then neither creates nor adds the bias: the fp8
      # product does both.
      override.enter_context(_set_for_one_call(module, "use_bias", False))
    else:
      override = _set_for_one_call(module, "dot_general_cls", functools.partial(
          Fp8DotGeneral, history_length=history_length))
  else:
    override = _reduced_gradients(module, policy.reduce_dtype)
  with override:
    yield


def _fp8_bias_inside(module: nn.Module, policy: Policy) -> bool:
  """Whether the delayed-scaling fp8 product adds this layer's bias: a
  Dense or DenseGeneral (flax's own call, no ``batch_dims``, flax's
  matmul) with a bias. Added to the 2-D product, the bias is the fp8
  GEMM's epilogue, and its gradient comes out of the kernel that quantizes
  the output gradient (:func:`jmp_lab.fp8.dot_general`), where flax's add
  left XLA to read that gradient once more (and, for a DenseGeneral's
  ``(heads, head_dim)`` bias, to broadcast the bias into a full matrix)."""
  return (policy.matmul not in (None, "fp8_current")
          and _runs_its_own_call(module, _FP8_MODULES) and module.use_bias
          and not getattr(module, "batch_dims", ())
          and module.dot_general is None and module.dot_general_cls is None)


def _fp8_bias_param(module: nn.Module) -> jax.Array:
  """The bias param of a Dense or DenseGeneral as flax creates it: the
  same name, shape, dtype and initializer (called with the flat shape, as
  DenseGeneral calls it; a Dense's shape is already flat), in the layer's
  scope, after its kernel (so from the same random key). Called by the
  layer's :class:`Fp8DotGeneral` during the layer's call."""
  features = tuple(np.atleast_1d(module.features).tolist())

  def init(rng, shape, dtype=jnp.float32):
    bias = module.bias_init(rng, (int(np.prod(shape)),), dtype)
    if isinstance(bias, flax.core.meta.AxisMetadata):
      return flax.core.meta.replace_boxed(bias, jnp.reshape(bias.unbox(),
                                                             shape))
    return jnp.reshape(bias, shape)

  return module.param("bias", init, features, module.param_dtype)


def _is_fp8_einsum(module: nn.Module, policy: Policy) -> bool:
  """An ``nn.Einsum`` (with flax's own ``promote_dtype``) under fp8."""
  return (policy.matmul is not None and _runs_its_own_call(module, (nn.Einsum,))
          and module.promote_dtype is flax_promote_dtype)


def _einsum_fp8_meta(module: nn.Einsum, policy: Policy, history_length: int):
  """The delayed-scaling state of an Einsum, in its own scope's
  ``_overwrite_with_gradient`` collection (None for current scaling)."""
  if policy.matmul == "fp8_current":
    return None
  return _fp8_meta(module, history_length)


def _fp8_einsum_call(module: nn.Einsum, args, kwargs,
                     meta: Optional[fp8.Fp8Meta], compute_dtype) -> jax.Array:
  """flax's ``nn.Einsum.__call__`` with its product as
  :func:`jmp_lab.fp8.einsum` (linen's Einsum has no matmul attribute to set).

  The params are flax's own: the same names, shapes, dtypes, initializers
  and order. The fp8 product is rematerialized with its quantization, so
  the backward GEMMs are fp8 inside ``nn.scan`` too (quantizing through
  ``promote_dtype`` instead left them 16-bit there: the dequantized operands
  crossed the loop as bf16 residuals), and the output gradient is quantized
  before the bias add, so the bias gradient is summed from the unquantized
  one, as a Dense's is. The operands are promoted to the policy's compute
  dtype, not to a ``dtype`` the layer pins: an fp8 GEMM returns the compute
  dtype anyway, and operands dequantized to fp32 and cast to bf16 on the
  way into the einsum's transposes compiled to 16-bit GEMMs on the H100.
  """
  inputs, _ = reduce_lib.flax_einsum_call(module, args, kwargs)
  # flax's rule: the equation given once, to the constructor or the call.
  subscripts = merge_param("einsum_str", module.einsum_str,
                           args[1] if len(args) > 1 else kwargs.get(
                               "einsum_str")).replace(" ", "")
  kernel = module.param("kernel", module.kernel_init, module.shape,
                        module.param_dtype)
  bias = None
  if module.use_bias:
    _, rhs_names, out_names = reduce_lib.einsum_subscripts(subscripts, inputs,
                                                           kernel)
    bias = module.param("bias", module.bias_init,
                        [kernel.shape[rhs_names.index(c)] for c in out_names
                         if c in rhs_names], module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias,
                                              dtype=compute_dtype)
  out = fp8.einsum(subscripts, inputs, kernel, meta=meta)
  if bias is not None:
    out = out + jnp.reshape(bias, reduce_lib.einsum_bias_broadcast(
        subscripts, inputs, kernel))
  return out


def _reduced_gradients(module: nn.Module, reduce_dtype):
  """Gives a Dense/DenseGeneral/Conv the reduce dtype's ``dot_general`` or
  ``conv_general_dilated`` for one call."""
  if reduce_dtype is None:
    return contextlib.nullcontext()
  if isinstance(module, _NOT_REDUCED_MODULES):
    warnings.warn(
        f"policy reduce dtype {np.dtype(reduce_dtype).name} does not reach "
        f"{type(module).__name__} {'/'.join(module.path)!r}: its weight "
        f"gradient is summed across devices in the compute dtype (jmp_lab "
        f"covers Dense, DenseGeneral, Conv, Einsum and Embed, and the biases "
        f"of all of them and of ConvTranspose and ConvLocal)", stacklevel=5)
  for cls, attribute, cls_attribute, factory in _REDUCIBLE_MODULES:
    if _is_exactly(module, cls):
      break
  else:
    return contextlib.nullcontext()
  if getattr(module, attribute) is not None or getattr(module, cls_attribute) is not None:
    return contextlib.nullcontext()
  return _set_for_one_call(module, attribute, factory(reduce_dtype))


def _abstract_key(tree: Any) -> Optional[tuple]:
  """A hashable key of ``tree``'s structure, shapes and dtypes (else None)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  key = (treedef, tuple(
      (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape")
      and hasattr(x, "dtype") else x for x in leaves))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def with_policy(
    module: nn.Module,
    policy: PolicySpec,
    *,
    class_overrides: Optional[Mapping[type, PolicySpec]] = None,
    path_overrides: Optional[Mapping[str, PolicySpec]] = None,
    fp32_norms: bool = True,
    fp8_history_length: int = fp8.AMAX_HISTORY_LENGTH,
    keep_layer_dtypes: bool = False,
) -> PolicyModule:
  """Applies ``policy`` to a linen module.

  Args:
    module: any ``flax.linen.Module``; its code is not changed.
    policy: the default policy (or its spec).
    class_overrides: ``{ModuleClass: policy}``; a module of that class and all
      modules inside it use that policy. Added to (and taking precedence over)
      the fp32 norm defaults.
    path_overrides: ``{regex: policy}`` matched with ``re.search`` against
      module paths (``"Block_0/Dense_1"``) and param paths
      (``"Block_0/Dense_1/kernel"``); these take precedence over classes.
    fp32_norms: compute norms in fp32 (see :func:`fp32_island`): flax's
      LayerNorm, RMSNorm, BatchNorm and GroupNorm, and every module whose
      class name ends in ``Norm`` (a model's own ``RMSNorm``; flax's
      ``WeightNorm`` and ``SpectralNorm`` wrappers excepted). A class
      override takes a norm class back (``{MyNorm: policy}``).
    fp8_history_length: the amax history of delayed fp8 scaling
      (``matmul="fp8"``).
    keep_layer_dtypes: a layer that sets its own ``dtype``
      (``nn.Dense(..., dtype=jnp.float32)``) computes in it, as without a
      policy. By default the policy wins: public model code passes a
      config's fp32 ``dtype`` to every layer, which would otherwise keep
      every matmul in fp32. To keep one layer in fp32 (an fp32 head), give
      it a path or class override instead.

  **How precision is decided.** Per module, by the policy and the
  overrides: a module's floating inputs and params are cast to its compute
  dtype and its outputs to the compute dtype (the model's own outputs to
  ``output_dtype``). Per op, by :func:`jmp_lab.autocast`'s rules inside
  every module call: each ``dot_general`` and convolution runs with operands
  in the module's compute dtype, even where a layer or a custom module
  casts them to fp32 first; exp, log, softmax's and the norms' reductions
  run in fp32 from half inputs. ``nn.MultiHeadDotProductAttention`` (and
  ``nn.SelfAttention``) with flax's default ``attention_fn`` gets
  :data:`dot_product_attention` (fp32 softmax).

  With ``matmul="fp8"`` (``"mixed_fp8"``) or ``"fp8_current"`` in
  ``policy``, Dense and DenseGeneral (so flax's attention projections too)
  run their matmuls as fp8 GEMMs (:mod:`jmp_lab.fp8`); with delayed scaling
  each gets an :class:`Fp8DotGeneral` whose state is in the
  ``_overwrite_with_gradient`` collection: keep it in
  ``TrainState.model_state`` and pass ``{"params": params,
  **state.model_state}`` to ``apply``. A path or class override without
  ``matmul`` keeps a module out of fp8 (e.g. ``{"head": "mixed_bfloat16"}``).

  With a ``reduce`` dtype in ``policy``, Dense and DenseGeneral compute their
  weight gradients in it and Embed reads its table in it (see the module
  doc and :func:`reduce_island`).

  Returns:
    A :class:`PolicyModule` with ``init`` and ``apply``.

  Raises:
    TypeError: if ``module`` is not a linen Module or an override key is not
      a class.
    ValueError: for a bad policy spec or an invalid regular expression.
  """
  if not isinstance(module, nn.Module):
    raise TypeError(
        f"with_policy needs a flax.linen.Module, got {type(module).__name__}")
  policy = get_policy(policy)
  defaults: dict[type, Policy] = {}
  if fp32_norms:
    defaults.update((cls, fp32_island(policy)) for cls in DEFAULT_FP32_MODULES)
  if policy.reduce_dtype is not None:
    defaults[nn.Embed] = reduce_island(policy)
  classes, patterns = resolve_overrides(class_overrides, path_overrides,
                                        defaults)
  if not isinstance(fp8_history_length, int) or fp8_history_length < 1:
    raise ValueError(f"fp8_history_length must be a positive int, got "
                     f"{fp8_history_length!r}")
  for name, flag in (("fp32_norms", fp32_norms),
                     ("keep_layer_dtypes", keep_layer_dtypes)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  return PolicyModule(module, policy, classes, patterns, fp8_history_length,
                      norm_island=fp32_island(policy) if fp32_norms else None,
                      keep_layer_dtypes=keep_layer_dtypes)


# --------------------------------------------------------------------------
# fp32 helpers for the numerically sensitive ops (jmp_lab.losses keeps them;
# these names stay for the code that imports them from here).
# --------------------------------------------------------------------------

softmax = losses.softmax
log_softmax = losses.log_softmax
softmax_cross_entropy_with_integer_labels = (
    losses.softmax_cross_entropy_with_integer_labels)


def dot_product_attention(query, key, value, bias=None, mask=None,
                          broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0,
                          deterministic: bool = False, dtype=None,
                          precision=None, module=None, *,
                          causal: bool = False, segment_ids=None,
                          implementation: str = "auto"):
  """``attention_fn`` for ``nn.MultiHeadDotProductAttention`` (and
  ``nn.SelfAttention``) with an fp32 softmax.

  With ``causal=True`` or ``segment_ids`` and no mask, bias, dropout or
  sown weights, it runs :func:`jmp_lab.attention.dot_product_attention`:
  a fused kernel on CUDA, with the softmax statistics in fp32 and no stored
  scores, and the materialized fp32-softmax path elsewhere. Its operands go
  in the compute dtype of the policy around it, even from a layer given
  ``dtype=jnp.float32``. Otherwise it is flax's ``nn.dot_product_attention``
  with ``force_fp32_for_softmax=True``, the causal and segment masks folded
  into ``mask``. :func:`with_policy` gives it to flax's attention modules
  that use flax's default ``attention_fn``.

  Example::

    >>> import functools, flax.linen as nn, jmp_lab.linen as jl
    >>> attention = nn.SelfAttention(num_heads=4, attention_fn=functools.partial(
    ...     jl.dot_product_attention, causal=True))   # call it without a mask
  """
  fusable = (mask is None and bias is None and module is None
             and (deterministic or dropout_rate == 0.0)
             and (causal or segment_ids is not None))
  if fusable:
    half = kernel_dtype(dtype, query)
    query, key, value = (x.astype(half) for x in (query, key, value))
    return attention_lib.dot_product_attention(
        query, key, value, causal=causal, segment_ids=segment_ids,
        implementation=implementation)
  mask = attention_lib.combined_mask(mask, query, key, causal, segment_ids)
  return nn.dot_product_attention(
      query, key, value, bias=bias, mask=mask,
      broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
      dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
      precision=precision, module=module, force_fp32_for_softmax=True)


def kernel_dtype(dtype, query) -> np.dtype:
  """The dtype a fused attention kernel runs in: the layer's own if half,
  else the compute dtype of the policy around the call, else the query's."""
  for candidate in (dtype, current_compute_dtype(), query.dtype):
    if candidate is not None and np.dtype(candidate) in (
        np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
      return np.dtype(candidate)
  return np.dtype(query.dtype)
