"""Flax linen layers, adapted for one call to what the plan decided.

The linen front end (:mod:`.linen`) asks the plan what a layer does; this
module carries it out with linen's mechanics, by setting a layer's
attributes for one call (Flax modules are frozen dataclasses built inside the
user's code, so the attribute is set on the instance and restored after):

* a layer's own ``dtype`` becomes its compute dtype;
* ``nn.Dense``/``nn.DenseGeneral`` get an fp8 ``dot_general`` (delayed
  scaling: :class:`Fp8DotGeneral`, which also adds the bias inside the fp8
  product) or the reduce dtype's (:func:`jmp_lab.reduce.dot_general`), and
  ``nn.Conv`` the reduce dtype's convolution; ``nn.Einsum`` under fp8 runs
  :func:`jmp_lab.fp8.einsum` in flax's place;
* flax's attention modules with flax's default ``attention_fn`` get
  :func:`jmp_lab.linen.dot_product_attention` (fp32 softmax);
* under a reduce dtype, a layer's bias and an ``nn.Einsum``'s kernel are
  read through ``stop_gradient`` and get their gradient attached after the
  call, summed in the reduce dtype (:func:`attach_gradients`); Flax's layers
  add their bias in the compute dtype, so its gradient would be summed in it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Mapping, Optional

import flax
import flax.linen as nn
from flax.linen.dtypes import promote_dtype as flax_promote_dtype
from flax.linen.module import merge_param
import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab._src.numerics import block_matmul, fp8_matmul, fp8_state
from jmp_lab._src.numerics import reduce as reduce_lib
from jmp_lab._src.precision import scopes
from jmp_lab._src.precision import flax_calls
from jmp_lab._src.precision.plan import CONV, DENSE, EINSUM, Decision, Plan
from jmp_lab._src.policy import (BLOCK_SCALED_MODES, FP8_MODES, MATMUL_MODES,
                                 layer_dtype)

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
_FP8_MODULES = (nn.Dense, nn.DenseGeneral)
_ATTENTION_MODULES = (nn.MultiHeadDotProductAttention,)  # SelfAttention too


def _runs_its_own_call(module: nn.Module, classes: tuple) -> bool:
  # A subclass that overrides __call__ may use its params otherwise.
  return any(isinstance(module, cls) and type(module).__call__ is cls.__call__
             for cls in classes)


def _is_exactly(module: nn.Module, cls: type) -> bool:
  return type(module) is cls or (isinstance(module, cls) and not isinstance(
      module, _NOT_REDUCED_MODULES))


def layer_kind(module: nn.Module) -> tuple[Optional[str], bool]:
  """``(kind, own_matmul)`` for :meth:`~.plan.Plan.matmul_mode`."""
  for cls, attribute, cls_attribute, _ in _REDUCIBLE_MODULES:
    if _is_exactly(module, cls):
      own = (getattr(module, attribute) is not None
             or getattr(module, cls_attribute) is not None)
      return (CONV if cls is nn.Conv else DENSE), own
  if _runs_its_own_call(module, (nn.Einsum,)):
    return EINSUM, module.promote_dtype is not flax_promote_dtype
  return None, False


def matmul_mode(plan: Plan, decision: Decision, module: nn.Module
                ) -> Optional[str]:
  return plan.matmul_mode(decision, *layer_kind(module))


@contextlib.contextmanager
def set_for_one_call(module: nn.Module, attribute: str, value: Any):
  """``module.<attribute>`` is ``value`` inside the block."""
  before = getattr(module, attribute)
  object.__setattr__(module, attribute, value)
  try:
    yield
  finally:
    object.__setattr__(module, attribute, before)


def call_layer(next_fun: Callable, module: nn.Module, method: str,
               args: tuple, kwargs: dict, plan: Plan, decision: Decision,
               history_length: int, attention_fn: Callable) -> Any:
  """The layer's call, adapted to the decision."""
  compute = decision.compute_dtype
  mode = matmul_mode(plan, decision, module)
  tied = plan.tied_logits(decision)
  if (method == "attend" and tied is not None and isinstance(module, nn.Embed)
      and type(module).attend is nn.Embed.attend):
    # The tied logits GEMM in the model's compute dtype, its table
    # gradient summed in the reduce dtype.
    with scopes.scope(tied[0]):
      return reduce_lib.embed_attend(args[0], module.embedding, *tied)
  if method == "__call__" and mode in MATMUL_MODES and (
      layer_kind(module)[0] == EINSUM):
    with scopes.scope(compute):
      return _quantized_einsum_call(
          module, args, kwargs, _einsum_product(module, mode, history_length),
          compute)
  with contextlib.ExitStack() as stack:
    # A tied head (attend) is the logits GEMM, kept in the compute dtype.
    own = (None if method == "attend"
           else plan.own_matmul(decision, mode, layer_kind(module)[1]))
    stack.enter_context(scopes.module_scope(compute, own))
    stack.enter_context(_own_dtype(module, plan.layer_dtype(decision)))
    stack.enter_context(_matmul_override(module, mode, decision,
                                         history_length))
    stack.enter_context(_attention(module, attention_fn))
    return next_fun(*args, **kwargs)


def _own_dtype(module: nn.Module, dtype: Optional[np.dtype]):
  """A layer's own ``dtype`` field (flax's computation dtype: None, or a
  floating dtype) set to ``dtype``."""
  fields = getattr(module, "__dataclass_fields__", {})
  if dtype is None or "dtype" not in fields or (
      module.dtype is not None and layer_dtype(module) is None):
    return contextlib.nullcontext()
  return set_for_one_call(module, "dtype", dtype)


def _attention(module: nn.Module, attention_fn: Callable):
  """A flax attention module that uses flax's default ``attention_fn``
  gets the fp32-softmax one."""
  if (isinstance(module, _ATTENTION_MODULES)
      and module.attention_fn is nn.dot_product_attention):
    return set_for_one_call(module, "attention_fn", attention_fn)
  return contextlib.nullcontext()


def _matmul_override(module: nn.Module, mode: Optional[str],
                     decision: Decision, history_length: int):
  """A Dense/DenseGeneral's ``dot_general`` (or ``dot_general_cls``) in
  fp8, or a Dense/DenseGeneral/Conv's matmul in the reduce dtype's."""
  if decision.as_written:
    return contextlib.nullcontext()
  policy = decision.policy
  if mode in BLOCK_SCALED_MODES and any(_is_exactly(module, cls)
                                        for cls in _FP8_MODULES):
    # As fp8_current: the operands in the compute dtype, also where the
    # layer pins float32.
    return set_for_one_call(module, "dot_general", fp8_matmul.operands_in(
        block_matmul.LAYER_MATMULS[mode][0], policy.compute_dtype))
  if mode in FP8_MODES and any(_is_exactly(module, cls)
                               for cls in _FP8_MODULES):
    if mode == "fp8_current":
      # In the compute dtype: a layer that pins float32 hands its matmul
      # fp32 operands, which compile to 16-bit GEMMs (the delayed mode's
      # Fp8DotGeneral is a module, whose inputs the interceptor casts).
      return set_for_one_call(module, "dot_general", fp8_matmul.operands_in(
          fp8_matmul.current_dot_general, policy.compute_dtype))
    if fp8_bias_inside(module, mode):
      stack = contextlib.ExitStack()
      stack.enter_context(set_for_one_call(
          module, "dot_general_cls", functools.partial(
              Fp8DotGeneral, history_length=history_length,
              bias_param=functools.partial(_fp8_bias_param, module))))
      # flax's call then neither creates nor adds the bias: the fp8
      # product does both.
      stack.enter_context(set_for_one_call(module, "use_bias", False))
      return stack
    return set_for_one_call(module, "dot_general_cls", functools.partial(
        Fp8DotGeneral, history_length=history_length))
  if policy.reduce_dtype is not None and isinstance(module,
                                                    _NOT_REDUCED_MODULES):
    warnings.warn(
        f"policy reduce dtype {np.dtype(policy.reduce_dtype).name} does not "
        f"reach {type(module).__name__} {'/'.join(module.path)!r}: its "
        f"weight gradient is summed across devices in the compute dtype "
        f"(jmp_lab covers Dense, DenseGeneral, Conv, Einsum and Embed, and "
        f"the biases of all of them and of ConvTranspose and ConvLocal)",
        stacklevel=2)
  if mode != "reduce":
    return contextlib.nullcontext()
  for cls, attribute, _, factory in _REDUCIBLE_MODULES:
    if _is_exactly(module, cls):
      return set_for_one_call(module, attribute, factory(policy.reduce_dtype))
  return contextlib.nullcontext()


# ---- gradients attached after a layer's call (reduce dtype) -----------------


def attached_params(module: nn.Module, plan: Plan, decision: Decision
                    ) -> tuple[str, ...]:
  """The params whose gradients are attached after the call: under a
  reduce dtype, every bias and an Einsum's kernel (not under fp8: its
  gradient comes out of the fp8 GEMM)."""
  mode = matmul_mode(plan, decision, module)
  if plan.bias_reduce_dtype(decision, False) is None:
    return ()
  names = []
  if layer_kind(module)[0] == EINSUM and mode == "reduce":
    names.append("kernel")
  if (_runs_its_own_call(module, _BIAS_MODULES) and module.use_bias
      and not getattr(module, "batch_dims", ())
      and plan.bias_reduce_dtype(decision,
                                 fp8_bias_inside(module, mode)) is not None):
    names.append("bias")
  return tuple(names)


def attach_gradients(module: nn.Module, out: Any, params: Mapping[str, Any],
                     args: tuple, kwargs: dict, compute_dtype: np.dtype,
                     reduce_dtype: np.dtype) -> Any:
  """``out`` with the gradients of ``params`` (the layer read them through
  ``stop_gradient``) attached, summed in ``reduce_dtype``."""
  einsum = isinstance(module, nn.Einsum)
  if einsum:
    inputs, subscripts = flax_calls.flax_einsum_call(module, args, kwargs)
    inputs = inputs.astype(compute_dtype)  # as flax's einsum saw it
    kernel = jax.ShapeDtypeStruct(tuple(module.shape), inputs.dtype)
  if "kernel" in params:
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


# ---- fp8 --------------------------------------------------------------------


class Fp8DotGeneral(nn.Module):
  """A delayed-scaling fp8 ``dot_general`` (:func:`jmp_lab.fp8.dot_general`)
  for ``nn.Dense``'s ``dot_general_cls``: its scales and amax histories are
  variables in the ``_overwrite_with_gradient`` collection
  (:data:`jmp_lab.fp8.COLLECTION`), which ``jmp_lab.train_step``
  differentiates and replaces with :func:`jmp_lab.fp8.next_meta` of their
  gradients (the amaxes the step observed)."""

  history_length: int = fp8_state.AMAX_HISTORY_LENGTH
  # Where the policy adds the layer's bias inside the fp8 product: a
  # function that returns the layer's bias param (see _fp8_bias_param).
  bias_param: Optional[Any] = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None):
    return fp8_matmul.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type,
        meta=fp8_meta(self, self.history_length),
        bias=None if self.bias_param is None else self.bias_param())


def fp8_meta(module: nn.Module, history_length: int) -> fp8_state.Fp8Meta:
  """``module``'s delayed-scaling state: variables in its own scope's
  :data:`jmp_lab.fp8.COLLECTION`, created by ``init``. A clear error where
  an ``apply`` has none (flax's says the collection is empty)."""
  initial = fp8_state.init_meta(history_length)
  if not module.is_mutable_collection(fp8_state.COLLECTION) and not all(
      module.has_variable(fp8_state.COLLECTION, name) for name in initial):
    where = ("init cannot create it" if module.is_initializing()
             else "this apply has none")
    raise ValueError(
        f"an fp8 policy keeps each fp8 matmul's scaling state in the "
        f"model's {fp8_state.COLLECTION!r} collection (jmp_lab.fp8.COLLECTION), "
        f"and {where} for {'/'.join(module.path)!r}. Pass every collection "
        f"init returned, not only 'params': model.apply({{'params': params, "
        f"**model_state}}, ...), as jmp_lab.TrainState.create(model_state="
        f"...) keeps them. A model that runs layers under nn.scan or nn.vmap "
        f"must list the collection there: nn.scan(..., variable_axes="
        f"{{'params': 0, jmp_lab.fp8.COLLECTION: 0}})")
  return {name: module.variable(fp8_state.COLLECTION, name, lambda v=v: v).value
          for name, v in initial.items()}


def fp8_bias_inside(module: nn.Module, mode: Optional[str]) -> bool:
  """Whether the delayed-scaling fp8 product adds this layer's bias: a
  Dense or DenseGeneral (flax's own call, no ``batch_dims``, flax's
  matmul) with a bias. Added to the 2-D product, the bias is the fp8
  GEMM's epilogue, and its gradient comes out of the kernel that quantizes
  the output gradient (:func:`jmp_lab.fp8.dot_general`), where flax's add
  left XLA to read that gradient once more (and, for a DenseGeneral's
  ``(heads, head_dim)`` bias, to broadcast the bias into a full matrix)."""
  return (mode == "fp8" and _runs_its_own_call(module, _FP8_MODULES)
          and module.use_bias and not getattr(module, "batch_dims", ())
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


def _einsum_product(module: nn.Einsum, mode: str, history_length: int
                    ) -> Callable[[str, jax.Array, jax.Array], jax.Array]:
  """The quantized einsum a linen Einsum runs under ``mode``."""
  if mode in BLOCK_SCALED_MODES:
    return functools.partial(block_matmul.einsum, fmt=mode)
  meta = None if mode == "fp8_current" else fp8_meta(module, history_length)
  return functools.partial(fp8_matmul.einsum, meta=meta)


def _quantized_einsum_call(module: nn.Einsum, args, kwargs,
                           product: Callable[..., jax.Array],
                           compute_dtype) -> jax.Array:
  """flax's ``nn.Einsum.__call__`` with its product as ``product``
  (:func:`jmp_lab.fp8.einsum` or :func:`jmp_lab.block_scaled.einsum`:
  linen's Einsum has no matmul attribute to set).

  The params are flax's own: the same names, shapes, dtypes, initializers
  and order. The fp8 product keeps its fp8 operands as its backward's
  residuals, so the backward GEMMs are fp8 inside ``nn.scan`` too (quantizing through
  ``promote_dtype`` instead left them 16-bit there: the dequantized operands
  crossed the loop as bf16 residuals), and the output gradient is quantized
  before the bias add, so the bias gradient is summed from the unquantized
  one, as a Dense's is. The operands are promoted to the policy's compute
  dtype, not to a ``dtype`` the layer pins: an fp8 GEMM returns the compute
  dtype anyway, and operands dequantized to fp32 and cast to bf16 on the
  way into the einsum's transposes compiled to 16-bit GEMMs on the H100.
  """
  inputs, _ = flax_calls.flax_einsum_call(module, args, kwargs)
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
  out = product(subscripts, inputs, kernel)
  if bias is not None:
    out = out + jnp.reshape(bias, reduce_lib.einsum_bias_broadcast(
        subscripts, inputs, kernel))
  return out
