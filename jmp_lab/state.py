"""The optimizer states of jmp_lab, and the accessors that read them.

Both optimizers keep the same public fields, so code that trains with one can
switch to the other:

* ``master_params`` -- the fp32 master (a tree, or a flat buffer for
  :func:`~jmp_lab.fused_adamw` with ``layout="flat"``), or None
  when the params are fp32 and are the master themselves;
* ``loss_scale`` -- the :class:`~jmp_lab.LossScale` for the next step;
* ``skipped_steps`` -- how many steps were skipped for non-finite gradients;
* ``last_step_applied`` -- whether the last ``update`` was applied (False when
  it was skipped), like optax's ``ApplyIfFiniteState.last_finite``.

The accessors find the one jmp_lab state by its type, however deeply it is
nested (inside ``optax.chain``, ``MultiSteps``, a ``TrainState``...).

Example::

  >>> import jax.numpy as jnp, optax, jmp_lab
  >>> tx = jmp_lab.mixed_precision(optax.sgd(0.1), policy="p=bf16",
  ...                              loss_scale=jmp_lab.StaticLossScale(8.0))
  >>> opt_state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
  >>> jmp_lab.master_params(opt_state)["w"].dtype
  dtype('float32')
  >>> float(jmp_lab.current_loss_scale(opt_state).loss_scale)
  8.0
  >>> bool(jmp_lab.last_step_applied(opt_state)), int(jmp_lab.skipped_steps(opt_state))
  (True, 0)
"""

from jmp_lab._src.optim.states import (FusedAdamWState, MixedPrecisionState,
                                      current_loss_scale, find_state,
                                      last_step_applied, master_params,
                                      optimizer_policy, QuantizedMoment,
                                      skipped_steps)

__all__ = ["FusedAdamWState", "MixedPrecisionState", "current_loss_scale",
           "find_state", "last_step_applied", "master_params",
           "optimizer_policy", "QuantizedMoment", "skipped_steps"]
