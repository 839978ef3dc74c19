"""Losses computed in fp32, including one that never stores the logits.

* :func:`softmax`, :func:`log_softmax` and
  :func:`softmax_cross_entropy_with_integer_labels` compute in fp32 from
  logits of any dtype. They are the helpers :mod:`jmp_lab.linen` and
  :mod:`jmp_lab.nnx` have exported, and keep those names there.
* :func:`linear_cross_entropy` is the cross-entropy of ``hidden @ kernel``
  (a language model's head and its loss) computed over vocabulary blocks.
  The log-sum-exp is taken in fp32 and the correct-class logit gathered per
  block. The backward pass recomputes each block (a ``custom_vjp``). The
  ``(tokens, vocabulary)`` logits are never stored, in any dtype: at
  GPT-2's 50,304 words and 8,192 tokens a step, they are 0.8 GB in bf16 and
  1.6 GB in fp32, read and written several times; at a 262k vocabulary,
  8.6 GB in fp32. On CUDA it runs three Pallas Triton kernels
  (:mod:`jmp_lab.kernels.linear_cross_entropy`, the design of Apple's Cut
  Cross-Entropy) that keep each tile of logits in registers; elsewhere, XLA
  computes it over vocabulary blocks (as Levanter's blockwise cross-entropy
  and Liger's FusedLinearCrossEntropy do), one block's logits in memory at
  a time. Pallas is reused for the kernels: its Triton backend compiles for
  an H100 without a GPU, and its interpret mode runs the same kernel bodies
  on a CPU for the tests.

Example::

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> hidden = jax.random.normal(jax.random.key(0), (2, 8, 16), jnp.bfloat16)
  >>> table = jax.random.normal(jax.random.key(1), (100, 16))  # tied embedding
  >>> labels = jnp.zeros((2, 8), jnp.int32)
  >>> loss = jmp_lab.losses.linear_cross_entropy(hidden, table.T, labels,
  ...                                             block_size=32)
  >>> loss.shape, loss.dtype
  ((2, 8), dtype('float32'))
"""

from jmp_lab._src.numerics.losses import (
    linear_cross_entropy,
    log_softmax,
    softmax,
    softmax_cross_entropy_with_integer_labels,
)

from jmp_lab._src.numerics import losses as _impl

#: The ``implementation`` values :func:`linear_cross_entropy` takes:
#: ``"auto"``, ``"triton"``, ``"interpret"``, ``"xla"``.
IMPLEMENTATIONS = _impl.IMPLEMENTATIONS
#: The vocabulary block of :func:`linear_cross_entropy` on XLA's path
#: (8192 words): its logits are the largest temporary.
DEFAULT_BLOCK = _impl.DEFAULT_BLOCK

__all__ = [
    "DEFAULT_BLOCK",
    "IMPLEMENTATIONS",
    "linear_cross_entropy",
    "log_softmax",
    "softmax",
    "softmax_cross_entropy_with_integer_labels",
]
