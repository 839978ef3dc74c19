"""Precision policies for Flax linen modules, without touching module code.

:func:`with_policy` wraps any linen module. Its ``init``/``apply`` mirror
linen's functional API and run under the precision engine
(:mod:`jmp_lab.precision`): the same rules :func:`jmp_lab.autocast` applies
to any function, with every module call a boundary
(``flax.linen.intercept_methods``):

* a module's floating inputs are cast to its compute dtype, and its outputs
  to the compute dtype (the model's own outputs to the policy's
  ``output_dtype``);
* its params are read in its compute dtype, in ``init`` and ``apply``
  alike; a layer's own ``dtype`` (``nn.Dense(..., dtype=jnp.float32)``)
  becomes its compute dtype for the call;
* a module's own helper methods are not boundaries: no casts at their
  arguments or results.

Which policy a module computes in is decided by rules, first match wins
(:class:`jmp_lab.precision.PrecisionRule`; ``rules=``), and the
``path_overrides``, ``class_overrides``, ``fp32_norms`` and
``keep_layer_dtypes`` arguments, which build rules. An override applies to
the module and everything inside it; a path pattern also matches single
params (``"head/kernel"``). By default the normalisation layers (every class
whose name ends in ``Norm``) compute in fp32 and hand back the compute dtype;
BatchNorm's ``batch_stats`` stay fp32. Only the ``params`` collection is ever
cast.

A policy with a ``reduce`` dtype (``"mixed_bfloat16,reduce=float32"``) has
the gradients summed across devices in it: ``nn.Dense`` and
``nn.DenseGeneral`` (and so flax's attention projections) get
:func:`jmp_lab.reduce.dot_general` as their ``dot_general``, ``nn.Conv``
:func:`jmp_lab.reduce.conv_general_dilated` (unless they set their own),
``nn.Embed`` looks its rows up in the reduce dtype, so the table's gradient
is accumulated in it, and ``nn.Einsum``'s kernel and every bias (of those
layers and of ``nn.ConvTranspose`` and ``nn.ConvLocal``) are read through
``stop_gradient`` and get their gradient attached after the call, summed in
the reduce dtype (:func:`jmp_lab.reduce.with_param_gradient`), inside
``nn.scan`` and ``nn.vmap`` too. Norms are fp32 islands already. Not covered
(a warning says so): the kernels of ``nn.ConvTranspose`` and ``nn.ConvLocal``.

Softmax and cross-entropy stay fp32 through the helpers here:
:func:`softmax`, :func:`softmax_cross_entropy_with_integer_labels`, and
:func:`dot_product_attention` (pass it as ``attention_fn`` to
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

from typing import Iterable, Mapping, Optional, Union

import flax.linen as nn

from jmp_lab._src.numerics import fp8_state as fp8
from jmp_lab._src.numerics import losses
from jmp_lab._src.precision import linen as _front_end
from jmp_lab._src.precision.linen import PolicyModule, dot_product_attention
from jmp_lab._src.precision.linen_layers import Fp8DotGeneral
from jmp_lab._src.precision.rules import PrecisionRule
# Older code imports these from here; jmp_lab.precision and
# jmp_lab.attention own them.
from jmp_lab._src.precision.rules import (  # noqa: F401
    fp32_island, layer_island, reduce_island)
from jmp_lab._src.numerics.attention import kernel_dtype  # noqa: F401
from jmp_lab._src.policy import Policy

#: The flax norms kept in fp32 by default (every class whose name ends in
#: ``Norm`` is: :func:`jmp_lab.policy.is_norm_class`).
DEFAULT_FP32_MODULES: tuple[type, ...] = (
    nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm)

PolicySpec = Union[Policy, str]

# fp32 helpers for the numerically sensitive ops (jmp_lab.losses keeps them;
# these names stay for the code that imports them from here).
softmax = losses.softmax
log_softmax = losses.log_softmax
softmax_cross_entropy_with_integer_labels = (
    losses.softmax_cross_entropy_with_integer_labels)


def with_policy(
    module: nn.Module,
    policy: PolicySpec,
    *,
    rules: Iterable[PrecisionRule] = (),
    class_overrides: Optional[Mapping[type, PolicySpec]] = None,
    path_overrides: Optional[Mapping[str, PolicySpec]] = None,
    fp32_norms: bool = True,
    fp8_history_length: int = fp8.AMAX_HISTORY_LENGTH,
    keep_layer_dtypes: bool = False,
    cache_dtype: Optional[str] = None,
) -> PolicyModule:
  """Applies ``policy`` to a linen module.

  Args:
    module: any ``flax.linen.Module``; its code is not changed.
    policy: the default policy (or its spec).
    rules: :class:`jmp_lab.precision.PrecisionRule` s, tried first, in
      order (first match wins).
    class_overrides: ``{ModuleClass: policy}``; a module of that class and all
      modules inside it use that policy. Added to (and taking precedence over)
      the fp32 norm defaults.
    path_overrides: ``{regex: policy}`` matched with ``re.search`` against
      module paths (``"Block_0/Dense_1"``) and param paths
      (``"Block_0/Dense_1/kernel"``); these take precedence over classes.
    fp32_norms: compute norms in fp32 (see
      :func:`jmp_lab.precision.fp32_island`): every module whose class name
      ends in ``Norm`` (flax's LayerNorm, RMSNorm, BatchNorm and GroupNorm,
      a model's own ``RMSNorm``; flax's ``WeightNorm`` and ``SpectralNorm``
      wrappers excepted). A class override takes a norm class back
      (``{MyNorm: policy}``).
    fp8_history_length: the amax history of delayed fp8 scaling
      (``matmul="fp8"``).
    keep_layer_dtypes: a layer that sets its own ``dtype``
      (``nn.Dense(..., dtype=jnp.float32)``) computes in it, as without a
      policy. By default the policy wins: public model code passes a
      config's fp32 ``dtype`` to every layer, which would otherwise keep
      every matmul in fp32. To keep one layer in fp32 (an fp32 head), give
      it a path or class override instead.
    cache_dtype: ``None`` keeps the ``cache`` collection in the dtype the
      model makes it (a float32 KV cache stays float32); ``"compute"``
      stores a new cache in its module's compute dtype (half the memory
      under bf16).

  **Module state** (the ``cache`` collection, batch statistics, any
  variable outside ``params``): a value a module call writes into it is
  cast to the dtype the variable holds, as torch casts a bf16 write into a
  float32 buffer; the ``cache`` collection is also read in the compute
  dtype inside a call, so ``dynamic_update_slice(cache, keys, ...)`` sees
  one dtype. A model that decodes with a float32 cache runs under any
  policy. A cache holding recurrent state is read in the compute dtype
  too, like the rest of its module's arithmetic: give that module an fp32
  override where it must accumulate in fp32.

  **How precision is decided.** Per module, by the rules (see the module
  doc); per op, by :mod:`jmp_lab.precision`'s rules inside every module
  call: each ``dot_general`` and convolution runs with operands in the
  module's compute dtype, even where a custom module casts them to fp32
  first; exp, log, softmax's and the norms' reductions run in fp32 from
  half inputs, and what the code explicitly upcasts stays fp32.
  ``nn.MultiHeadDotProductAttention`` (and ``nn.SelfAttention``) with
  flax's default ``attention_fn`` gets :func:`dot_product_attention` (fp32
  softmax).

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
  doc and :func:`jmp_lab.precision.reduce_island`).

  Returns:
    A :class:`PolicyModule` with ``init`` and ``apply``.

  Raises:
    TypeError: if ``module`` is not a linen Module (a ``PolicyModule``: the
      policy was applied already), or an override key is not a class.
    ValueError: for a bad policy spec or an invalid regular expression.
  """
  return _front_end.with_policy(
      module, policy, rules=rules, class_overrides=class_overrides,
      path_overrides=path_overrides, fp32_norms=fp32_norms,
      fp8_history_length=fp8_history_length,
      keep_layer_dtypes=keep_layer_dtypes, cache_dtype=cache_dtype)


__all__ = [
    "DEFAULT_FP32_MODULES", "Fp8DotGeneral", "PolicyModule",
    "dot_product_attention", "log_softmax", "softmax",
    "softmax_cross_entropy_with_integer_labels", "with_policy",
]
