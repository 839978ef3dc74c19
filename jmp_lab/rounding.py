"""Stochastic rounding to bf16, and the counter-based random bits it needs.

``master="none"`` with ``rounding="stochastic"`` updates bf16 params without
an fp32 master: each new fp32 value is rounded up or down to a neighbouring
bf16 value with probability by distance, so updates far below half a bf16 ulp
survive in expectation.

* :func:`stochastic_round_bf16` adds 16 random bits below the bf16 mantissa
  of the fp32 bit pattern and truncates. It is integer arithmetic, which XLA
  has no excess-precision rewrite for (jax issue 23007 is about bf16 *float*
  error terms becoming 0 under ``jit``).
* :func:`counter_bits` makes those bits from a seed, a stream number and the
  element's index with an integer hash (no random-number generator): a kernel
  can compute them per element (Triton has no RNG that jax exposes), and the
  reference computes the very same bits, so every backend rounds alike.

Element-wise jnp on uint32 only, so every kernel backend can call it.

Example::

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.full((4096,), 1.0 + 2.0**-9, jnp.float32)  # 1/4 of a bf16 ulp up
  >>> seed = step_seed(jnp.array([0, 7], jnp.uint32), jnp.int32(0))
  >>> bits = counter_bits(seed, 0, jnp.arange(4096))
  >>> rounded = stochastic_round_bf16(x, bits).astype(jnp.float32)
  >>> sorted(set(rounded.tolist()))
  [1.0, 1.0078125]
  >>> round(float(rounded.mean()), 3) == round(1.0 + 2.0**-9, 3)
  True
"""

from jmp_lab.kernels.rounding import (
    counter_bits,
    hash32,
    noise_stream_key,
    step_seed,
    stochastic_round_bf16,
    uniform_from_bits,
)

__all__ = [
    "counter_bits",
    "hash32",
    "noise_stream_key",
    "step_seed",
    "stochastic_round_bf16",
    "uniform_from_bits",
]
