"""jmp_lab: mixed-precision training for JAX and Flax on NVIDIA GPUs.

The public API lives here; each concept has its own module:

* :mod:`jmp_lab.policy` -- precision policies and cast helpers;
* :mod:`jmp_lab.loss_scale` -- loss scales, ``all_finite`` and ``select_tree``.
"""

from jmp_lab.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jmp_lab.policy import (
    PRESETS,
    Policy,
    cast_floating,
    get_policy,
    half_dtype,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "PRESETS",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_floating",
    "get_policy",
    "half_dtype",
    "select_tree",
]
