"""Precision as one engine: the same rules for every route.

``jmp_lab.autocast(fn, policy)`` (any JAX function), and
:func:`jmp_lab.linen.with_policy` and :func:`jmp_lab.nnx.with_policy` (Flax
models), decide precision with the same rules, so the same model gets the
same program by each route. Under a half policy:

* **Matmuls and convolutions** run in the compute dtype with fp32
  accumulation, whatever dtype their operands arrive in (:data:`MATMUL_OPS`).
  Integer and fp8 matmuls are left alone.
* **fp32 islands stay fp32**: the ops of :data:`FP32_OPS` (exp, log,
  rsqrt, the sum reductions...) and the ops that only feed them, so
  softmax, log-sum-exp, norm statistics and losses run in fp32 from half
  inputs; an explicit ``astype(float32)`` of a half value; values built from
  integers (positions, rotary angles); norm layers (by the module rules);
  the loss in a train step (:func:`island`). An op that mixes an fp32 value
  with a half one runs in fp32, as torch's promotion does.
* **Everything else computes in the compute dtype** (:data:`COMPUTE_OPS`):
  floating params, arguments and constants are read in it where they are
  used, a weakly typed literal never promotes, and ``custom_jvp``,
  ``custom_vjp``, ``scan``, ``while``, ``cond`` and ``checkpoint`` keep the
  dtypes the rules chose.

Which modules compute in what is decided by :class:`PrecisionRule` s, an
ordered list, first match wins (``with_policy(..., rules=...)``; the
``class_overrides``, ``path_overrides``, ``fp32_norms`` and
``keep_layer_dtypes`` arguments build them). :func:`scope` marks a region of
any function.

Example::

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> def mlp(params, x):                      # plain JAX, fp32 params
  ...   h = jax.nn.relu(x @ params["w1"] + params["b1"])
  ...   return jax.nn.log_softmax(h @ params["w2"])
  >>> params = {"w1": jnp.ones((8, 16)), "b1": jnp.zeros(16),
  ...           "w2": jnp.ones((16, 4))}
  >>> fast = jmp_lab.autocast(mlp, "mixed_bfloat16")
  >>> fast(params, jnp.ones((2, 8))).dtype                     # output_dtype
  dtype('float32')
  >>> report = jmp_lab.diagnostics.audit_step(fast, params, jnp.ones((2, 8)))
  >>> report.half_flop_share
  1.0
"""

from jmp_lab._src.precision.api import Autocast, autocast
from jmp_lab._src.precision.interpreter import apply_rules, is_tracing
from jmp_lab._src.precision.rules import (PrecisionRule, Rules,
                                          fp32_island, layer_island,
                                          make_rules, reduce_island)
from jmp_lab._src.precision.scopes import (current_compute_dtype, island,
                                           policy_cast_scope, scope)
from jmp_lab._src.precision_warnings import (MatmulCount, PrecisionWarning,
                                             recording, warn_unless_half)

from jmp_lab._src.precision import ops as _ops
from jmp_lab._src.precision import rules as _rules

#: The keyword actions of a :class:`PrecisionRule` (besides a policy):
#: ``"fp32"``: an fp32 island (params in the param dtype, computation in
#: fp32, the output handed back in the compute dtype); ``"layer_dtype"``:
#: the layer computes in its own ``dtype`` (a rule with it matches only
#: layers that set one); ``"as_written"``: no casts and no op rules;
#: ``"fp8"``/``"fp8_current"``: the policy's Dense/Linear matmuls in fp8;
#: ``"reduce"``: computes in the reduce dtype (an embedding table whose
#: gradient is summed in it) and hands back the compute dtype.
ACTIONS = _rules.ACTIONS
#: Primitives that run in the compute dtype whatever dtype their operands
#: arrive in (with fp32 accumulation): ``dot_general`` and
#: ``conv_general_dilated``.
MATMUL_OPS = _ops.MATMUL_OPS
#: Primitives computed in fp32 from half inputs: exp, log, and the sum,
#: product and cumulative reductions (softmax, logsumexp, norms written
#: inline and losses are built from these). ``x ** 2`` and ``x ** 3``
#: are not: ``jax.nn.gelu`` computes ``x ** 3``, and torch runs GELU in its
#: input's dtype.
FP32_OPS = _ops.FP32_OPS
#: Primitives that compute in the compute dtype (elementwise arithmetic,
#: layout changes, comparisons...). An input the rules made fp32 (an
#: island's result, an explicit upcast) makes the op run in fp32, as
#: torch's promotion does.
COMPUTE_OPS = _ops.COMPUTE_OPS

__all__ = [
    "ACTIONS", "Autocast", "COMPUTE_OPS", "FP32_OPS", "MATMUL_OPS",
    "MatmulCount", "PrecisionRule", "PrecisionWarning", "Rules", "apply_rules",
    "autocast", "current_compute_dtype", "fp32_island", "is_tracing",
    "island", "layer_island", "make_rules", "policy_cast_scope", "recording",
    "reduce_island", "scope", "warn_unless_half",
]
