"""jmp's API on jmp_lab's classes: ``from jmp_lab import jmp`` migrates.

Code written for DeepMind's jmp runs unchanged against this module, and gets
jmp_lab's fixes with it: ``min_loss_scale`` survives flattening, the scale is
always an f32 leaf (an fp16 scale works, and a new static scale does not
recompile), the dynamic scale has an upper bound (``2**24`` by default) and
never becomes non-finite. The objects are jmp_lab's own, so they go straight
into :func:`jmp_lab.mixed_precision` and the rest of jmp_lab.

Where jmp_lab differs from jmp on purpose, jmp's tests fail here; README.md
lists each difference and why.

Example::

  >>> import jax.numpy as jnp
  >>> from jmp_lab import jmp
  >>> policy = jmp.get_policy("p=f32,c=f16,o=f32")
  >>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
  dtype('float16')
  >>> scale = jmp.DynamicLossScale(jnp.float32(2.0**15), period=2, factor=2)
  >>> scale = scale.adjust(jmp.all_finite({"g": jnp.ones(2)}))
  >>> scale = scale.adjust(jnp.bool_(True))
  >>> float(scale.loss_scale), scale.period, scale.factor
  (65536.0, 2, 2.0)
"""

from jmp_lab._src.jmp_compat import (
    all_finite,
    cast_to_full,
    cast_to_half,
    DynamicLossScale,
    get_policy,
    half_dtype,
    LossScale,
    NoOpLossScale,
    Policy,
    select_tree,
    StaticLossScale,
)
from jmp_lab._src import jmp_compat as _impl

#: As in jmp: the names of each dtype, keyed by the jnp scalar types; the
#: first name is what ``str(policy)`` prints.
dtype_to_names = _impl.dtype_to_names

__all__ = [
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "dtype_to_names",
    "DynamicLossScale",
    "get_policy",
    "half_dtype",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "select_tree",
    "StaticLossScale",
]
