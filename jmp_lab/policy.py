"""Precision policies: which dtype params, computation and outputs use.

A :class:`Policy` is three dtypes and three cast methods, in the spirit of
jmp, plus an optional fourth dtype, ``reduce_dtype``: the dtype gradients are
in when they are summed across devices. :func:`get_policy` parses the jmp
string grammar (and agrees with ``jmp.get_policy`` on every string jmp
accepts), the ``reduce``/``r`` key, and a few named presets.

Example::

  >>> import jmp_lab
  >>> policy = jmp_lab.get_policy("params=float32,compute=bfloat16,output=float32")
  >>> policy == jmp_lab.get_policy("mixed_bfloat16")
  True
  >>> str(policy)
  'params=float32,compute=bfloat16,output=float32'
  >>> str(jmp_lab.get_policy("mixed_bfloat16,r=f32"))
  'params=float32,compute=bfloat16,output=float32,reduce=float32'
"""

from jmp_lab._src.policy import (
    canonicalize_dtype,
    cast_floating,
    get_policy,
    half_dtype,
    is_norm_class,
    layer_dtype,
    Policy,
    )
from jmp_lab._src import policy as _impl

#: The policies :func:`get_policy` knows by name: ``"float32"``,
#: ``"mixed_bfloat16"``, ``"mixed_float16"`` (fp32 params and output, half
#: compute) and ``"mixed_fp8"`` (bf16 compute, the Dense/Linear matmuls in
#: fp8 with delayed scaling).
PRESETS = _impl.PRESETS

__all__ = [
    "canonicalize_dtype",
    "cast_floating",
    "get_policy",
    "half_dtype",
    "is_norm_class",
    "layer_dtype",
    "Policy",
    "PRESETS",
]
