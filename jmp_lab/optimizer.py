"""An optax wrapper that keeps fp32 master weights and the loss-scale state.

``mixed_precision(inner, policy=..., loss_scale=...)`` turns any optax
transformation into a mixed-precision one. The wrapper's state holds:

* ``master_params`` -- an fp32 copy of the params, or None when the params are
  already float32/float64 (then they *are* the master and no copy is kept);
* ``inner_state`` -- the wrapped transformation's state, which only ever sees
  fp32 master weights and unscaled fp32 gradients;
* ``loss_scale`` -- the :class:`~jmp_lab.LossScale`;
* ``skipped_steps`` -- how many steps were skipped for non-finite gradients.

One ``update`` does, on device and without a host sync:

1. unscale the param-dtype gradients to fp32 and check, once and globally,
   that they are finite: gradients of the scaled loss, marked as
   :class:`~jmp_lab.ScaledGradients` (from
   :func:`~jmp_lab.scaled_value_and_grad`), are divided by the loss scale;
   plain gradients are the unscaled loss's and divided by 1 (with a
   :class:`~jmp_lab.precision.PrecisionWarning` once where the loss scale is
   not ``NoOpLossScale``: the loss was not scaled, so fp16 gradients may
   underflow);
2. run ``inner.update`` on the fp32 master;
3. if anything was non-finite, keep the master and the inner state exactly as
   they were (so ``count`` and LR schedules do not advance), count the skip
   and back the scale off; otherwise take the new master and maybe grow the
   scale;
4. return updates such that ``optax.apply_updates(params, updates)`` equals
   ``cast(new_master, param_dtype)`` bit for bit.

Gradient accumulation: wrap the accumulator *inside*,
``mixed_precision(optax.MultiSteps(inner, k), ...)``. Each micro-batch's
gradients are then unscaled with the scale they were computed under before
they are accumulated in fp32, so the loss scale may change freely inside an
accumulation window without mixing scales. A non-finite micro-batch is dropped
(the accumulator does not see it; the window waits for one more finite
micro-batch) and the scale backs off. ``optax.MultiSteps(mixed_precision(...))``
would accumulate *scaled* half-precision gradients across scale changes; do
not do that.

Example::

  >>> import jax, jax.numpy as jnp, optax, jmp_lab
  >>> tx = jmp_lab.mixed_precision(
  ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
  ...     policy="p=bf16,c=bf16,o=f32", loss_scale=jmp_lab.DynamicLossScale())
  >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> grads = jmp_lab.ScaledGradients(  # gradients of the scaled loss
  ...     {"w": jnp.full(3, 2.0**15, jnp.bfloat16)})
  >>> updates, state = tx.update(grads, state, params)
  >>> params = optax.apply_updates(params, updates)
  >>> bool(jnp.all(params["w"] == jmp_lab.master_params(state)["w"].astype(jnp.bfloat16)))
  True
  >>> grads = jmp_lab.ScaledGradients(  # an overflow: skipped
  ...     {"w": jnp.full(3, jnp.inf, jnp.bfloat16)})
  >>> updates, state = tx.update(grads, state, params)
  >>> bool(state.last_step_applied), int(state.skipped_steps)
  (False, 1)
"""

from jmp_lab._src.optim.mixed_precision import (MixedPrecisionUpdate,
                                               mixed_precision)
from jmp_lab._src.optim.quantized_adam import (QuantizedAdamState,
                                               quantized_adamw,
                                               scale_by_quantized_adam)

__all__ = ["MixedPrecisionUpdate", "mixed_precision", "QuantizedAdamState",
           "quantized_adamw", "scale_by_quantized_adam"]
