"""Stochastic rounding to bf16, and the counter-based random bits it needs.

The arithmetic behind :mod:`jmp_lab.rounding` (whose docstring describes it with
examples), here because every kernel backend computes it on loaded values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_LOW_BITS = 0xFFFF


def _u32(value: int) -> jax.Array:
  return jnp.uint32(value)


def hash32(x: jax.Array) -> jax.Array:
  """A bijective integer hash of uint32 values (Wellons' "lowbias32")."""
  x = x ^ (x >> _u32(16))
  x = x * _u32(0x7FEB352D)
  x = x ^ (x >> _u32(15))
  x = x * _u32(0x846CA68B)
  return x ^ (x >> _u32(16))


def over_constant(x: jax.Array, divisor) -> jax.Array:
  """``x`` (fp32) over the constant ``divisor``, as ``x`` times the fp32
  reciprocal of ``divisor``: the same bits eagerly and under ``jax.jit``.

  XLA compiles a division by a constant as that product, in a jitted
  program and in some eager ops but not others (on the CPU, jax 0.10.2: a
  scalar divided eagerly is divided). The two differ in the last bit for
  about a quarter of fp32 values; a scale one bit apart rounds a value on
  an E2M1 or E4M3 tie the other way. Written as the product, every path
  computes what a jitted step does.

  >>> import jax.numpy as jnp
  >>> amax = jnp.float32(3.234375)
  >>> float(over_constant(amax, 2688.0)), float(amax / 2688.0)
  (0.0012032645754516125, 0.0012032644590362906)
  """
  reciprocal = np.float32(1.0) / np.asarray(divisor, np.float32)
  return x * jnp.asarray(reciprocal, jnp.float32)


def step_seed(key_data: jax.Array, count: jax.Array) -> jax.Array:
  """The uint32 seed of step ``count`` (applied steps) under a key.

  A skipped step does not advance ``count``, so it draws nothing: the next
  step rounds with the same bits it would have had.
  """
  words = jnp.ravel(key_data).astype(jnp.uint32)
  seed = hash32(count.astype(jnp.uint32) ^ _u32(0x9E3779B9))
  for k in range(words.shape[0]):
    seed = hash32(seed ^ words[k])
  return seed


def noise_stream_key(seed: jax.Array, stream: int) -> jax.Array:
  """The uint32 key of one ``stream`` under ``seed``: what
  :func:`counter_bits` hashes each index with (a kernel that draws the
  same bits takes it as an operand)."""
  return hash32(seed ^ hash32(_u32(stream)))


def uniform_from_bits(bits: jax.Array) -> jax.Array:
  """Uniform [0, 1) fp32 noise from 32 random bits: their top 24 bits over
  2**24 (exact in fp32)."""
  return (bits >> _u32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)


def counter_bits(seed: jax.Array, stream: int, index: jax.Array) -> jax.Array:
  """32 random bits for each ``index`` (int32 or uint32) of ``stream``.

  Distinct (stream, index) pairs give independent-looking bits; one stream
  (a leaf of the params) has no repeats, since the hash is a bijection.
  """
  stream_key = noise_stream_key(seed, stream)
  index = jax.lax.bitcast_convert_type(index, jnp.uint32) if (
      index.dtype == jnp.int32) else index.astype(jnp.uint32)
  return hash32(index ^ stream_key)


def global_index(local: jax.Array, local_shape: tuple[int, ...],
                 global_shape: tuple[int, ...], base: jax.Array) -> jax.Array:
  """The flat index in the whole leaf of each element of a shard.

  ``local`` holds flat (row-major) indices into a shard of shape
  ``local_shape`` of a leaf of shape ``global_shape``; ``base`` is the whole
  leaf's flat index of the shard's first element (:func:`shard_base`). A
  device that rounds its own shard with ``counter_bits`` of these indices
  draws the very bits one device rounding the whole leaf draws: the
  coordinates are ``base``'s plus the local ones, and the flat index is
  linear in the coordinates. On a whole leaf (``local_shape ==
  global_shape``, ``base == 0``) it is ``local``.

  >>> import jax.numpy as jnp
  >>> # columns 2..3 of rows 4..5 of a (6, 4) leaf: its elements 18, 19, 22, 23
  >>> global_index(jnp.arange(4), (2, 2), (6, 4), jnp.int32(4 * 4 + 2)).tolist()
  [18, 19, 22, 23]
  """
  if tuple(local_shape) == tuple(global_shape):
    return local + base
  index = base
  for dim, size in enumerate(local_shape):
    local_stride = math.prod(local_shape[dim + 1:])
    global_stride = math.prod(global_shape[dim + 1:])
    coordinate = (local // local_stride) % size if dim else local // local_stride
    index = index + coordinate * global_stride
  return index


def shard_base(offsets: tuple[jax.Array, ...],
               global_shape: tuple[int, ...]) -> jax.Array:
  """The flat index in a leaf of shape ``global_shape`` of the element at
  ``offsets`` (a shard's first element, one offset per dimension)."""
  base = jnp.int32(0)
  for dim, offset in enumerate(offsets):
    base = base + offset * math.prod(global_shape[dim + 1:])
  return base


def stochastic_round_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
  """``x`` (fp32) rounded to bf16, up with probability by distance.

  ``bits`` (uint32, the shape of ``x``): uniform random bits; the low 16 are
  used. As with round to nearest, a value within a bf16 ulp of bf16's
  largest finite number may round to inf.
  """
  pattern = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  noise = bits.astype(jnp.uint32) & _u32(_LOW_BITS)
  truncated = (pattern + noise) & _u32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(truncated, jnp.float32).astype(
      jnp.bfloat16)


__all__ = [
    "over_constant",
    "global_index",
    "shard_base",
    "counter_bits",
    "hash32",
    "noise_stream_key",
    "step_seed",
    "uniform_from_bits",
    "stochastic_round_bf16",
]
