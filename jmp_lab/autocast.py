"""``jmp_lab.autocast``: kept for the import paths that name it.

The engine's public names live in :mod:`jmp_lab.precision`;
``jmp_lab.autocast`` itself is the function
(:func:`jmp_lab.precision.autocast`), with ``jmp_lab.autocast.scope`` and
``jmp_lab.autocast.FP32_OPS`` as aliases of :func:`jmp_lab.precision.scope`
and :data:`jmp_lab.precision.FP32_OPS`.
"""

from jmp_lab._src.precision.api import autocast
from jmp_lab._src.precision.interpreter import apply_rules, is_tracing
from jmp_lab._src.precision.ops import FP32_OPS, MATMUL_OPS
from jmp_lab._src.precision.rules import Rules, make_rules
from jmp_lab._src.precision.scopes import (current_compute_dtype,
                                           policy_cast_scope, scope)
from jmp_lab._src.precision_warnings import (MatmulCount, PrecisionWarning,
                                             recording, warn_unless_half)

# ``jmp_lab.autocast`` is the function, which hides this module: its two
# names in the docs stay reachable from it.
autocast.scope = scope
autocast.FP32_OPS = FP32_OPS

__all__ = ["FP32_OPS", "MATMUL_OPS", "MatmulCount", "PrecisionWarning",
           "Rules", "apply_rules", "autocast", "current_compute_dtype",
           "is_tracing", "make_rules", "policy_cast_scope", "recording",
           "scope", "warn_unless_half"]
