"""Attention whose fp32 softmax lives inside a fused kernel, chosen by target.

Flax's attention with an fp32 softmax writes the whole ``(batch, heads, T,
T)`` score tensor in fp32 and reads it back, forward and backward: bytes
and temporaries that grow with ``T**2`` (the compiled-for-H100 figures are in
``benchmarks/RESULTS.md``). A fused kernel keeps the score tile and the
softmax statistics on chip: bf16/fp16 operands, fp32 statistics and
accumulators, forward and backward.

:func:`dot_product_attention` takes ``causal=True`` and ``segment_ids``
instead of a mask. Without a mask, a bias or active dropout, the call is
fused. The kernel is chosen by the platform the step is *compiled for*
(``jax.lax.platform_dependent``, as :func:`jmp_lab.fused_adamw`'s ``"auto"``
does), not by the first local device:

* ``"cudnn"`` -- cuDNN's fused attention, through
  ``jax.nn.dot_product_attention(..., implementation="cudnn")``: the
  production path on Hopper, and the default on CUDA. It needs cuDNN
  (``nvidia-cudnn-cu12``; the ``gpu-compile`` extra installs it, so a step
  compiles for an H100 on a machine without a GPU), bf16 or fp16 operands
  and a head dim that is a multiple of 8, up to 128. It takes no
  ``segment_ids``.
* ``"triton"`` -- jax's Pallas attention for GPUs
  (``jax.experimental.pallas.ops.gpu.attention.mha``). It takes
  ``segment_ids``, and sequence lengths that are a multiple of its block
  (up to 128). The backend is deprecated upstream in jax 0.11, where it warns.
* ``"mosaic"`` -- jax's Mosaic GPU attention for Hopper
  (``attention_mgpu``): head dims that are a multiple of 64 and sequence
  lengths that are a multiple of 128. It takes no ``segment_ids``. It is not
  chosen by ``"auto"`` (``benchmarks/RESULTS.md`` has the comparison).
* ``"xla"`` -- the materialized path: scores in the inputs' dtype, the
  mask, softmax and dropout in fp32. This is what runs on any other platform,
  so on a CPU the same call gives the same numbers, and it is the fallback
  on CUDA for what no kernel takes. A call that asked for ``causal`` or
  ``segment_ids`` and still cannot be fused (a mask, a bias, dropout, or
  shapes no kernel takes) warns once.

jax's own kernels are reused rather than written anew: they are maintained
with jax, compile for an H100 without a GPU, and each has a backward pass.
None of them does dropout. An explicit ``implementation`` other than
``"auto"`` is taken as asked on every platform, so that a step can be
compiled for a GPU on a machine without one. Lowering that step for the CPU
then fails, as ``fused_adamw(backend="triton")`` does.

The front ends use this function: :func:`jmp_lab.linen.dot_product_attention`
and :func:`jmp_lab.nnx.dot_product_attention` are its ``attention_fn``
forms, so ``attention_fn=functools.partial(jl.dot_product_attention,
causal=True)`` with no mask runs the fused kernel on CUDA.

Example::

  >>> import jax, jax.numpy as jnp, jmp_lab
  >>> q = k = v = jnp.ones((2, 16, 4, 32), jnp.bfloat16)   # (batch, T, heads, dim)
  >>> out = jmp_lab.attention.dot_product_attention(q, k, v, causal=True)
  >>> out.shape, out.dtype
  ((2, 16, 4, 32), dtype(bfloat16))
"""

from jmp_lab._src.numerics.attention import (
    attention_fn,
    combined_mask,
    dot_product_attention,
    kernel_dtype,
)

from jmp_lab._src.numerics import attention as _impl

#: The ``implementation`` values :func:`dot_product_attention` takes:
#: ``"auto"``, ``"cudnn"``, ``"triton"``, ``"mosaic"``, ``"xla"``.
IMPLEMENTATIONS = _impl.IMPLEMENTATIONS

__all__ = [
    "attention_fn",
    "combined_mask",
    "dot_product_attention",
    "IMPLEMENTATIONS",
    "kernel_dtype",
]
