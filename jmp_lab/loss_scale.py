"""Loss scaling: keeps small fp16 gradients from flushing to zero.

Three loss scales share one interface:

* ``.loss_scale`` -- the current scale, an f32 scalar array;
* ``.scale(tree)`` -- multiplies floating leaves by the scale (keeps dtypes);
* ``.unscale(tree)`` -- divides by the scale; the result is float32 (float64
  leaves stay float64);
* ``.adjust(grads_finite)`` -- returns the scale to use for the next step.

Each is a pytree. What changes from step to step (the scale, the growth
counter) is a leaf, so it can be traced, donated, sharded and checkpointed;
configuration (growth interval, factors, bounds) is static auxiliary data that
survives ``tree_flatten``/``tree_unflatten`` intact. jmp drops
``min_loss_scale`` on flatten; the round-trip tests guard against that.

Example::

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> scale = jmp_lab.DynamicLossScale(loss_scale=2.0**15, growth_interval=2)
  >>> grads = scale.unscale(jax.grad(lambda w: scale.scale(w * w))(3.0))
  >>> scale = scale.adjust(jmp_lab.all_finite(grads))
"""

from jmp_lab._src.optim.gate import all_finite
from jmp_lab._src.optim.scaled import default_loss_scale
from jmp_lab._src.loss_scale import (
    check_loss_scale,
    DynamicLossScale,
    fresh_copy,
    LossScale,
    NoOpLossScale,
    select_tree,
    StaticLossScale,
)

__all__ = [
    "all_finite",
    "check_loss_scale",
    "default_loss_scale",
    "DynamicLossScale",
    "fresh_copy",
    "LossScale",
    "NoOpLossScale",
    "select_tree",
    "StaticLossScale",
]
