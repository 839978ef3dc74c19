"""The op lists the rules are made of, by primitive name (data: the
interpreter's handlers and the module rules read them)."""

#: Primitives that run in the compute dtype whatever dtype their operands
#: arrive in (with fp32 accumulation).
MATMUL_OPS = frozenset({"dot_general", "conv_general_dilated",
                        "ragged_dot_general"})

#: Primitives that run in fp32 from half inputs (torch.autocast's fp32 list,
#: as JAX primitives): exponentials and logarithms, ``pow``, rsqrt, the
#: inverse trigonometric and hyperbolic functions torch lists, and the sum,
#: product and cumulative reductions. Softmax, logsumexp, norms written
#: inline and losses are built from these. ``x ** 2`` and ``x ** 3``
#: (``integer_pow``, ``square``) are not: jax.nn.gelu computes ``x ** 3``,
#: and torch runs GELU in its input's dtype.
FP32_OPS = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "pow", "rsqrt", "tan", "asin",
    "acos", "sinh", "cosh", "erf_inv", "reduce_sum", "reduce_prod", "cumsum",
    "cumprod", "cumlogsumexp",
})

#: Primitives that compute in the compute dtype (elementwise arithmetic,
#: layout changes, comparisons...). Their params and constants are read in
#: it; an input the rules made fp32 (an island's result, an explicit upcast)
#: makes the op run in fp32, as torch's promotion does.
COMPUTE_OPS = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "sign", "abs",
    "floor", "ceil", "round", "nextafter", "sqrt", "cbrt", "tanh", "logistic",
    "square", "integer_pow",
    "sin", "cos", "atan", "atan2", "asinh", "acosh", "atanh", "erf", "erfc",
    "lgamma", "digamma", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "clamp", "stop_gradient", "copy", "copy_p", "reduce_max",
    "reduce_min", "argmax", "argmin", "cummax", "cummin", "broadcast_in_dim",
    "reshape", "transpose", "squeeze", "expand_dims", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "sharding_constraint", "reduce_precision", "sort", "split",
    "optimization_barrier",
})
