"""Weight gradients in the policy's reduce dtype: a drop-in ``dot_general``.

Under data parallelism (a batch sharded over devices, params replicated),
XLA's partitioner sums a weight gradient across devices where its GEMM makes
the per-device partial sums: the all-reduce (or, with sharded optimizer
state, the reduce-scatter) takes the GEMM's output dtype. With bf16 compute
that is bf16, so the sum over devices rounds to 8 bits of mantissa at every
step of the reduction (jax issue 27496; torch FSDP's ``reduce_dtype`` exists
for this).

:func:`dot_general` is ``lax.dot_general`` with one change in its gradient:
the weight (right-hand) gradient's GEMM keeps its bf16 or fp16 operands but
accumulates and returns in ``reduce_dtype`` (``preferred_element_type``), so
the partitioner's reduction runs in it; only then is the gradient cast to the
weight's dtype. The forward pass and the input gradient are unchanged.
:func:`conv_general_dilated` does the same for ``lax.conv_general_dilated``.
:func:`jmp_lab.linen.with_policy` injects them into ``nn.Dense``,
``nn.DenseGeneral`` (their ``dot_general`` attribute) and ``nn.Conv`` (its
``conv_general_dilated``) when a policy has a ``reduce`` dtype.

Example::

  >>> import jax, jax.numpy as jnp
  >>> dot = dot_general(jnp.float32)
  >>> x, w = jnp.ones((8, 4), jnp.bfloat16), jnp.ones((4, 3), jnp.bfloat16)
  >>> dims = (((1,), (0,)), ((), ()))
  >>> loss = lambda w: dot(x, w, dims).astype(jnp.float32).sum()
  >>> jax.grad(loss)(w).dtype, float(jax.grad(loss)(w)[0, 0])
  (dtype(bfloat16), 8.0)
"""

from jmp_lab._src.numerics.reduce import (
    bias_gradient,
    conv_general_dilated,
    dot_general,
    einsum,
    einsum_bias_broadcast,
    einsum_rhs_gradient,
    einsum_subscripts,
    embed_attend,
    with_param_gradient,
)

__all__ = [
    "bias_gradient",
    "conv_general_dilated",
    "dot_general",
    "einsum",
    "einsum_bias_broadcast",
    "einsum_rhs_gradient",
    "einsum_subscripts",
    "embed_attend",
    "with_param_gradient",
]
