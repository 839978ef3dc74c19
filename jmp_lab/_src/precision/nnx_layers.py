"""Flax NNX layers, given what the plan decided for their matmuls.

NNX modules are objects built once, so :func:`jmp_lab.nnx.with_policy` sets
their attributes in place (calling it again takes back what an earlier
policy gave): a ``Linear``/``LinearGeneral``/``Conv``/``Einsum`` gets the
reduce dtype's matmul (:mod:`jmp_lab.reduce`), or the current-scaling fp8
one, or an :class:`Fp8State` variable with its delayed-scaling state. The
policy class's call (:mod:`.nnx`) swaps in the delayed fp8 matmul for each
call, and attaches bias gradients in the reduce dtype.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_lab._src.numerics import block_matmul, fp8_matmul, fp8_state
from jmp_lab._src.numerics import reduce as reduce_lib
from jmp_lab._src.precision import flax_calls
from jmp_lab._src.precision.plan import CONV, DENSE, EINSUM, Decision, Plan


class Fp8State(nnx.Variable):
  """The delayed fp8 scaling state of one Linear (:func:`jmp_lab.fp8.init_meta`):
  differentiated by :func:`jmp_lab.nnx.train_step`, which replaces it with
  :func:`jmp_lab.fp8.next_meta` of its gradient (the amaxes the step
  observed); never seen by the optimizer (``wrt=nnx.Param`` leaves it out)."""


def base_class(module: nnx.Module) -> type:
  """The class a module had before :func:`jmp_lab.nnx.with_policy`."""
  return getattr(type(module), "_jmp_lab_base", type(module))


def policy_dtypes(module: nnx.Module) -> Optional[tuple[np.dtype, np.dtype]]:
  """``(compute_dtype, output_dtype)`` that :func:`jmp_lab.nnx.with_policy`
  gave ``module``'s calls, or None when it has no policy."""
  return getattr(type(module), "_jmp_lab_dtypes", None)


@contextlib.contextmanager
def swapped(module: nnx.Module, attribute: str, value: Any):
  """``module.<attribute>`` is ``value`` inside the block."""
  default = getattr(module, attribute)
  object.__setattr__(module, attribute, value)
  try:
    yield
  finally:
    object.__setattr__(module, attribute, default)


# Modules whose matmul or convolution is an attribute (see jmp_lab.reduce):
# (class, attribute, flax's default, the reduce-dtype version's factory).
_REDUCIBLE_MODULES = (
    (nnx.Linear, "dot_general", jax.lax.dot_general, reduce_lib.dot_general),
    (nnx.LinearGeneral, "dot_general", jax.lax.dot_general,
     reduce_lib.dot_general),
    (nnx.Conv, "conv_general_dilated", jax.lax.conv_general_dilated,
     reduce_lib.conv_general_dilated),
    (nnx.Einsum, "einsum_op", jnp.einsum, reduce_lib.einsum),
)
_KINDS = {nnx.Linear: DENSE, nnx.LinearGeneral: DENSE, nnx.Conv: CONV,
          nnx.Einsum: EINSUM}
# Modules whose matmul can run in fp8: (class, its matmul attribute, the
# default, the current-scaling version, the delayed-scaling factory).
FP8_MODULES = (
    (nnx.Linear, "dot_general", jax.lax.dot_general, fp8_matmul.current_dot_general,
     fp8_matmul.delayed_dot_general),
    (nnx.LinearGeneral, "dot_general", jax.lax.dot_general,
     fp8_matmul.current_dot_general, fp8_matmul.delayed_dot_general),
    (nnx.Einsum, "einsum_op", jnp.einsum, fp8_matmul.current_einsum,
     fp8_matmul.delayed_einsum),
)
# Layers that add their bias broadcast over their output's leading axes
# (nnx.Einsum: over the axes its equation says).
_BIAS_MODULES = (nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose,
                 nnx.Einsum)

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


def fp8_entry(module: nnx.Module) -> Optional[tuple]:
  return next((entry for entry in FP8_MODULES
               if base_class(module) is entry[0]), None)


def stateless_matmuls(module: nnx.Module) -> dict[str, Callable]:
  """The matmuls a policy may give ``module`` that keep no state, by mode:
  current-scaling fp8 and the block-scaled ones (empty for other layers)."""
  entry = fp8_entry(module)
  if entry is None:
    return {}
  einsum = entry[1] == "einsum_op"
  return {"fp8_current": entry[3],
          **{mode: block_matmul.LAYER_MATMULS[mode][int(einsum)]
             for mode in block_matmul.LAYER_MATMULS}}


def _is_stateless_matmul(module: nnx.Module, value: Any) -> bool:
  return any(value is fn for fn in stateless_matmuls(module).values())


def layer_kind(module: nnx.Module) -> tuple[Optional[str], bool]:
  """``(kind, own_matmul)`` for :meth:`~.plan.Plan.matmul_mode`: a layer
  given a matmul of its own (``dot_general=``; jmp_lab's current-scaling
  one counts as flax's)."""
  base = base_class(module)
  own = False
  for cls, attribute, default, factory in _REDUCIBLE_MODULES:
    if base is cls:
      value = getattr(module, attribute)
      own = not (_runs_flax_matmul(module, attribute, default)
                 or value in _INSTALLED
                 or _is_stateless_matmul(module, value))
  return _KINDS.get(base), own


def matmul_mode(plan: Plan, decision: Decision, module: nnx.Module
                ) -> Optional[str]:
  """The plan's matmul for ``module``: a layer keeps a matmul of its own."""
  return plan.matmul_mode(decision, *layer_kind(module))


def set_matmul(module: nnx.Module, mode: Optional[str],
               reduce_dtype: Optional[np.dtype], history_length: int) -> None:
  """Gives a layer the matmul of ``mode`` (and takes back what an earlier
  policy gave it): the reduce dtype's, the current-scaling fp8 one, or an
  :class:`Fp8State` for delayed scaling."""
  for cls, attribute, default, _ in _REDUCIBLE_MODULES:
    if base_class(module) is cls and getattr(module, attribute) in _INSTALLED:
      setattr(module, attribute, default)
  entry = fp8_entry(module)
  if entry is not None:
    _, attribute, default, _, _ = entry
    if _is_stateless_matmul(module, getattr(module, attribute)):
      setattr(module, attribute, default)
    if mode in stateless_matmuls(module):
      setattr(module, attribute, stateless_matmuls(module)[mode])
  _set_fp8_meta(module, mode == "fp8", history_length)
  if mode == "reduce":
    for cls, attribute, _, factory in _REDUCIBLE_MODULES:
      if base_class(module) is cls:
        setattr(module, attribute, _reduced(factory, np.dtype(reduce_dtype)))


def _set_fp8_meta(module: nnx.Module, wanted: bool,
                  history_length: int) -> None:
  has_meta = isinstance(getattr(module, "fp8_meta", None), Fp8State)
  if wanted and not has_meta:
    # One state per layer of a stack (layers built under nnx.vmap, run
    # under nnx.scan): its leading axes are the kernel's stacking axes.
    layers = _stacking_shape(module)
    module.fp8_meta = Fp8State(jax.tree_util.tree_map(
        lambda v: jnp.broadcast_to(v, layers + v.shape),
        fp8_state.init_meta(history_length)))
  elif not wanted and has_meta:
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


def fp8_bias_inside(module: nnx.Module) -> bool:
  """Whether a delayed-scaling fp8 layer's bias is added inside its fp8
  product (:func:`jmp_lab.fp8.dot_general`): a Linear, or a LinearGeneral
  without batch axes, that has a bias. There the GEMM adds it (cuBLASLt's
  bias epilogue) and the kernel that quantizes the output gradient sums
  its gradient in fp32, in the same pass; flax's own add left XLA to read
  that gradient once more (and a LinearGeneral's multi-axis bias to be
  broadcast into a full matrix first)."""
  return (base_class(module) in (nnx.Linear, nnx.LinearGeneral)
          and getattr(module, "bias", None) is not None
          and not getattr(module, "batch_axis", None))


def bias_reduce_dtype(module: nnx.Module, plan: Plan, decision: Decision,
                      mode: Optional[str]) -> Optional[np.dtype]:
  """The reduce dtype for ``module``'s bias gradient, if it is attached."""
  if (base_class(module) not in _BIAS_MODULES
      or not isinstance(getattr(module, "bias", None), nnx.Param)
      or getattr(module, "batch_axis", None)):
    return None
  dtype = plan.bias_reduce_dtype(
      decision, mode == "fp8" and fp8_bias_inside(module))
  return None if dtype is None else np.dtype(dtype)


def bias_broadcast(module: nnx.Module, bias_shape, args, kwargs) -> tuple:
  """How ``module`` broadcasts its bias onto its output (flax's rule)."""
  if not isinstance(module, nnx.Einsum):
    return tuple(bias_shape)
  inputs, subscripts = flax_calls.flax_einsum_call(module, args, kwargs)
  return reduce_lib.einsum_bias_broadcast(subscripts, inputs,
                                          module.kernel.get_raw_value())


def delayed_fp8_matmul(module: nnx.Module, compute: np.dtype,
                       stack: contextlib.ExitStack) -> bool:
  """For one call: the layer's matmul attribute is the delayed-scaling fp8
  matmul that reads (and, differentiated, updates) its :class:`Fp8State`,
  adding the layer's bias where :func:`fp8_bias_inside`. Returns whether the
  bias went inside."""
  _, attribute, _, _, delayed = fp8_entry(module)
  meta = module.fp8_meta.get_value()
  inside = fp8_bias_inside(module)
  matmul = delayed(meta, bias=module.bias[...]) if inside else delayed(meta)
  if inside:  # flax's call then neither reads nor adds it
    stack.enter_context(swapped(module, "bias", None))
    stack.enter_context(swapped(module, "use_bias", False))
  stack.enter_context(swapped(module, attribute, fp8_matmul.operands_in(
      matmul, compute, einsum=attribute == "einsum_op")))
  return inside


def current_fp8_operands(module: nnx.Module, compute: np.dtype,
                         stack: contextlib.ExitStack) -> None:
  """For one call: a stateless quantized matmul (current-scaling fp8,
  block-scaled) gets its operands in the compute dtype."""
  entry = fp8_entry(module)
  if entry is not None and _is_stateless_matmul(module,
                                                getattr(module, entry[1])):
    stack.enter_context(swapped(module, entry[1], fp8_matmul.operands_in(
        getattr(module, entry[1]), compute,
        einsum=entry[1] == "einsum_op")))
