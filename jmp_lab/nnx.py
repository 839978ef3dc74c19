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
  casts inputs and outputs and runs under the precision engine
  (:mod:`jmp_lab.precision`; one subclass per class and decision, cached;
  ``isinstance``, attribute names, graph paths and checkpoints are
  unchanged); a module's other methods are not boundaries;
* each ``nnx.Param`` becomes a :class:`PolicyParam`, the custom ``Variable``
  type Flax recommends for cast-on-read: its stored value stays in
  ``param_dtype`` (what ``nnx.state``, the optimizer and checkpoints see) and
  ``param[...]`` returns it in the compute dtype, in Flax's layers and in your
  own modules alike. Gradients flow back through the cast to the stored dtype.

Which policy each module computes in is decided by the same rules as
:func:`jmp_lab.linen.with_policy`'s (:class:`jmp_lab.precision.PrecisionRule`).

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

import warnings
from typing import Iterable, Mapping, Optional, Union

from flax import nnx

from jmp_lab._src.numerics import fp8_state as fp8
from jmp_lab._src.precision import nnx as _front_end
from jmp_lab._src.precision.nnx import PolicyParam, dot_product_attention
from jmp_lab._src.precision.nnx_layers import Fp8State, policy_dtypes
from jmp_lab._src.precision.rules import PrecisionRule
from jmp_lab._src.numerics.losses import (log_softmax, softmax,
                            softmax_cross_entropy_with_integer_labels)
from jmp_lab._src.policy import Policy

#: The flax norms kept in fp32 by default (every class whose name ends in
#: ``Norm`` is: :func:`jmp_lab.policy.is_norm_class`).
DEFAULT_FP32_MODULES: tuple[type, ...] = (
    nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)

PolicySpec = Union[Policy, str]


def with_policy(
    model: nnx.Module,
    policy: PolicySpec,
    *,
    rules: Iterable[PrecisionRule] = (),
    class_overrides: Optional[Mapping[type, PolicySpec]] = None,
    path_overrides: Optional[Mapping[str, PolicySpec]] = None,
    fp32_norms: bool = True,
    fp8_history_length: int = fp8.AMAX_HISTORY_LENGTH,
    keep_layer_dtypes: bool = False,
    cache_dtype: Optional[str] = None,
) -> nnx.Module:
  """Applies ``policy`` to an NNX module graph, in place; returns ``model``.

  The model itself is changed (NNX modules are mutable graphs; nothing is
  copied): after the call ``model``, and every reference to it, runs under
  the policy. ``nnx.clone(model)`` first keeps an unchanged copy.

  Args:
    model: a constructed ``flax.nnx.Module``; its code is not changed.
    policy: the default policy (or its spec).
    rules: :class:`jmp_lab.precision.PrecisionRule` s, tried first, in
      order (first match wins).
    class_overrides: ``{ModuleClass: policy}``; a module of that class and
      all modules inside it use that policy. Added to (and taking precedence
      over) the fp32 norm defaults.
    path_overrides: ``{regex: policy}`` matched with ``re.search`` against
      module paths (``"blocks/0/mlp"``) and param paths
      (``"blocks/0/mlp/kernel"``); these take precedence over classes.
    fp32_norms: compute norms in fp32 (:func:`jmp_lab.precision.fp32_island`):
      flax's LayerNorm, RMSNorm, BatchNorm and GroupNorm, and every module
      whose class name ends in ``Norm`` (a model's own ``RMSNorm``; flax's
      ``WeightNorm`` and ``SpectralNorm`` excepted). A class override takes
      a norm class back.
    fp8_history_length: the amax history of delayed fp8 scaling.
    keep_layer_dtypes: a layer that sets its own ``dtype`` computes in it.
      By default the policy wins over a layer's ``dtype`` (public model
      code passes ``dtype=jnp.float32`` to every layer); give an fp32 head
      a path or class override instead.
    cache_dtype: ``None`` keeps each ``nnx.Cache`` in the dtype the model
      made it (a float32 KV cache stays float32); ``"compute"`` stores the
      caches in their module's compute dtype (half the memory under bf16).

  **Module state** (a KV cache, a buffer, any non-param floating variable
  but batch statistics): a value a policed call writes into it is cast to
  the variable's stored dtype, as torch casts a bf16 write into a float32
  buffer; an ``nnx.Cache`` is also read in the compute dtype inside a
  call, so ``dynamic_update_slice(cache, keys, ...)`` sees one dtype. A
  model that decodes with a float32 cache runs under any policy, and a
  cache made after this call (Flax's ``MultiHeadAttention.init_cache``) is
  treated so at its module's next call. A cache holding recurrent state is
  read in the compute dtype too, like the rest of its module's arithmetic:
  give that module an fp32 override where it must accumulate in fp32.

  **How precision is decided:** as in :func:`jmp_lab.linen.with_policy`,
  per module (policy, overrides) and per op: every module call runs under
  :mod:`jmp_lab.precision`'s rules in its compute dtype, so Flax's layers
  with ``dtype=jnp.float32``, ``Embed.attend`` and your own modules'
  matmuls all run in the compute dtype, and their exp, log and reductions
  in fp32.

  With ``matmul="fp8"`` (``"mixed_fp8"``) in ``policy``, every Linear and
  LinearGeneral (so the attention projections too) runs its matmul as an
  fp8 GEMM (:mod:`jmp_lab.fp8`) and gets an ``fp8_meta``
  (:class:`Fp8State`) variable with its scaling state; ``"fp8_current"``
  needs no state. An override without ``matmul`` keeps a module in the
  compute dtype.

  Calling it again on the same model replaces the policy.

  Raises:
    TypeError: if ``model`` is not an NNX Module or an override key is not a
      class.
    ValueError: for a bad policy spec or an invalid regular expression.
  """
  return _front_end.with_policy(
      model, policy, rules=rules, class_overrides=class_overrides,
      path_overrides=path_overrides, fp32_norms=fp32_norms,
      fp8_history_length=fp8_history_length,
      keep_layer_dtypes=keep_layer_dtypes, cache_dtype=cache_dtype)


from jmp_lab._src.training.nnx_step import (Optimizer, make_train_step,
                                             split_train_step, train_step)


__all__ = [
    "DEFAULT_FP32_MODULES", "Fp8State", "Optimizer", "PolicyParam", "dot_product_attention",
    "log_softmax", "make_train_step", "policy_dtypes", "softmax",
    "softmax_cross_entropy_with_integer_labels", "split_train_step",
    "train_step", "with_policy",
]


def __getattr__(name: str):
  # ``Fp8Meta`` was this module's name for the variable class until it was
  # renamed: jmp_lab.fp8.Fp8Meta is the dict of scaling arrays it holds.
  if name == "Fp8Meta":
    warnings.warn("jmp_lab.nnx.Fp8Meta is now jmp_lab.nnx.Fp8State "
                  "(jmp_lab.fp8.Fp8Meta is the dict it holds)",
                  DeprecationWarning, stacklevel=2)
    return Fp8State
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
