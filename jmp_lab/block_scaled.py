"""Blackwell's block-scaled matmuls: MXFP8 and NVFP4 training.

A policy with ``matmul="mxfp8"`` or ``matmul="nvfp4"`` (the ``"mixed_mxfp8"``
and ``"mixed_nvfp4"`` presets) runs the Dense/Linear, DenseGeneral/
LinearGeneral and Einsum matmuls of :func:`jmp_lab.linen.with_policy` and
:func:`jmp_lab.nnx.with_policy` (also those that pin ``dtype=float32``, and
inside ``nn.scan``/``nnx.scan`` and remat) through :func:`dot_general`
(:func:`einsum`): forward, input-gradient and weight-gradient GEMMs all
block-scaled, each operand quantized along its own contraction axis.

* **MXFP8**: E4M3 values (activations, weights and gradients: E5M2
  gradients diverged in NVIDIA's MXFP8 runs), one E8M0 power-of-two scale
  per 32 values, rounded up (``amax / 448`` to the next power of two).
* **NVFP4**, the full training recipe of NVIDIA's NVFP4 paper (arXiv
  2509.25149) and Transformer Engine's ``NVFP4BlockScaling``: E2M1 values,
  one E4M3 scale per 16 values, a per-tensor fp32 scale from the tensor's
  amax; 16x16 blocks for weights; stochastic rounding for gradients; the
  16-wide random Hadamard transform on the weight-gradient GEMM's operands.
  All three GEMMs are fp4 (jax's own ``scaled_dot_general`` runs NVFP4's
  backward in bf16). :func:`nvfp4_recipe` switches pieces off.

**No new RNG stream.** Stochastic rounding draws its noise from a key made
of the gradient's own contents (the bits of its fp32 amax, hashed): a
model's ``apply`` is called as before, a repeated computation rounds the
same way, and each step's new gradients draw new noise. The Hadamard
transform's signs are a fixed constant.

**Shapes that are not whole blocks** (a contraction axis, or a token count
in the weight gradient, that is not a multiple of 32 or 16) are padded with
zeros to whole blocks: the product is unchanged, nothing raises, and the
padded GEMM is a block-scaled GEMM like the others (the audit counts it).

**Where it runs:** on Blackwell (compute capability 10.x) XLA lowers each
GEMM to cuDNN's ``__cudnn$blockScaledDot`` (cuDNN 9.10 or newer); on an
older GPU to dequantize plus a 16-bit GEMM, with a warning, once; on a CPU
the same quantized operands are multiplied exactly in fp32 (an emulation
with the GPU's numbers). :mod:`jmp_lab.diagnostics` compiles for a B200
without one (``target="b200"``).

>>> import jax, jax.numpy as jnp
>>> import jmp_lab
>>> x = jax.random.normal(jax.random.key(0), (4, 64), jnp.bfloat16)
>>> w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
>>> y = jmp_lab.block_scaled.dot_general(x, w, (((1,), (0,)), ((), ())),
...                                      fmt="mxfp8")
>>> y.shape, y.dtype
((4, 32), dtype(bfloat16))
>>> exact = x.astype(jnp.float32) @ w.astype(jnp.float32)
>>> bool(jnp.max(jnp.abs(y - exact)) < 0.1 * jnp.max(jnp.abs(exact)))
True

A weight on the left (``w @ x``, as Equinox's ``Linear`` computes it) is
named with ``weight="lhs"``; the product is the same, transposed:

>>> y_t = jmp_lab.block_scaled.dot_general(w.T, x, (((1,), (1,)), ((), ())),
...                                        fmt="mxfp8", weight="lhs")
>>> bool((y_t == y.T).all())
True
"""

from jmp_lab._src.numerics.block_matmul import (Recipe, dot_general, einsum,
                                                mxfp8_recipe, nvfp4_recipe,
                                                recipe_for)
from jmp_lab._src.numerics.block_quantize import (MXFP8, NVFP4, BlockFormat,
                                                  Quantized,
                                                  dequantize, hadamard_16,
                                                  quantize_mxfp8,
                                                  quantize_nvfp4)
from jmp_lab._src.numerics.product_remat import checkpoint_policy

__all__ = [
    "BlockFormat",
    "MXFP8",
    "NVFP4",
    "Quantized",
    "Recipe",
    "checkpoint_policy",
    "dequantize",
    "dot_general",
    "einsum",
    "hadamard_16",
    "mxfp8_recipe",
    "nvfp4_recipe",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "recipe_for",
]
