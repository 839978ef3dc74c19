"""One mixed-precision training step, readable top to bottom.

* :func:`scaled_value_and_grad` -- differentiates ``loss * scale``; returns
  the unscaled loss (with aux) and the scaled gradients in the param dtype,
  marked as :class:`ScaledGradients`.
* :class:`ScaledGradients` -- the mark a jmp_lab optimizer reads: it divides
  marked gradients by its loss scale, and takes plain ones as the gradients
  of the unscaled loss.
* :class:`TrainState` -- ``params``, ``opt_state``, ``apply_fn`` and
  ``policy`` (plus ``model_state`` for collections such as ``batch_stats``,
  and ``rngs``, the base keys of dropout and other random streams, whose
  per-step keys ``step_rngs()`` gives), with ``apply_gradients``, in the
  spirit of ``flax.training.train_state``.
* :func:`train_step` / :func:`make_train_step` -- the jitted, donated step;
  ``grad_norm=True`` / ``grads=True`` add the unscaled gradients' norm and
  the gradients to its metrics.

The data flow of one step (see :func:`train_step`):

1. the master params (fp32) live in the optimizer state; ``state.params`` are
   in the policy's ``param_dtype``;
2. forward: the policy casts params and inputs to ``compute_dtype`` (fp32 for
   norms), outputs to ``output_dtype``; the loss is fp32;
3. ``loss * scale`` is differentiated; gradients come back scaled, in the
   param dtype;
4. the optimizer (:func:`jmp_lab.mixed_precision`) unscales, checks
   finiteness, updates the fp32 master, skips on overflow and adjusts the
   scale; the params handed back equal ``cast(master)`` exactly;
5. on a skipped step nothing else changes either: ``model_state`` (e.g. batch
   statistics) and ``step`` keep their old values.

In your own loop (Flax's ``TrainState.apply_gradients``, ``tx.update`` and
``optax.apply_updates``, ``nnx.Optimizer.update``, Equinox) the optimizer
reads the mark, so a loop is safe whichever gradients it hands over:

* gradients from :func:`scaled_value_and_grad` (marked) are divided by the
  loss scale, as in the train step: this is the way to train in fp16;
* plain gradients (``jax.grad`` of the loss) are taken as the unscaled
  loss's: divided by 1, checked, a non-finite step skipped (the dynamic
  scale still backs off on it, and grows on finite steps, unused). Where
  the optimizer's loss scale is not ``NoOpLossScale`` (``mixed_float16``'s
  ``DynamicLossScale``) a :class:`~jmp_lab.precision.PrecisionWarning` says
  once per optimizer that the loss was not scaled, so fp16 gradients may
  underflow, and names the fix. Under bf16 and fp32 (no loss scale) plain
  gradients are the ordinary way, and nothing warns.

A tree of gradients you scaled yourself goes in as ``ScaledGradients(grads)``.
See the "your own loop" guide.
"""

from jmp_lab._src.training.linen_step import (
    TrainState,
    make_train_step,
    train_step,
)
from jmp_lab._src.optim.scaled import ScaledGradients
from jmp_lab._src.training import step as _step
from jmp_lab._src.training.value_and_grad import scaled_value_and_grad

#: The name scope of the optimizer update inside a train step
#: (``"jmp_lab_update"``): compiled reports find its kernels and bytes by it
#: (:meth:`jmp_lab.diagnostics.CompiledReport.scope`).
UPDATE_SCOPE = _step.UPDATE_SCOPE

__all__ = [
    "make_train_step",
    "scaled_value_and_grad",
    "ScaledGradients",
    "train_step",
    "TrainState",
    "UPDATE_SCOPE",
]
