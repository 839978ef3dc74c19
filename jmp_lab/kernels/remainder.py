"""Half params and their fp32 master, exactly: the remainder and the landing.

The arithmetic behind :mod:`jmp_lab.remainder` (whose docstring describes it with
examples), here because every kernel backend computes it on loaded values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_HALF_ULP = 0x8000


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(bf16 params, uint16 remainder)`` of an fp32 master (not a tie)."""
  params = master.astype(jnp.bfloat16)
  return params, (_bits(master) & 0xFFFF).astype(jnp.uint16)


def join(params: jax.Array, remainder: jax.Array) -> jax.Array:
  """The fp32 master that :func:`split` made ``(params, remainder)`` from."""
  upper = jax.lax.bitcast_convert_type(params, jnp.uint16).astype(jnp.uint32)
  rem = remainder.astype(jnp.uint32)
  upper = upper - (rem >= _HALF_ULP).astype(jnp.uint32)  # rounding went up
  return jax.lax.bitcast_convert_type((upper << 16) | rem, jnp.float32)


def untie(master: jax.Array) -> jax.Array:
  """``master`` moved off exact bf16 ties (one fp32 ulp, towards its bf16).

  Elementwise jnp on fp32 values: every kernel backend can call it.
  """
  bits = _bits(master)
  tie = (bits & 0xFFFF) == _HALF_ULP
  # Round-to-nearest-even goes up from an odd upper half, down from an even.
  rounds_up = ((bits >> 16) & 1) == 1
  nudged = jnp.where(rounds_up, bits + 1, bits - 1)
  return jax.lax.bitcast_convert_type(jnp.where(tie, nudged, bits),
                                      jnp.float32)


class ReachableHalf(NamedTuple):
  master: jax.Array   # the new fp32 master, snapped where needed
  half: jax.Array     # the half value the params land on (== cast(master))
  update: jax.Array   # the fp32 update that takes the old params there


def reachable_half(old_half: jax.Array, new_master: jax.Array,
                   half_dtype) -> ReachableHalf:
  """Where ``apply_updates`` can take params ``old_half`` towards ``new_master``.

  Args:
    old_half: the current params (any float dtype holding half values).
    new_master: the new fp32 master.
    half_dtype: the params' dtype.

  Example::

    >>> import jax.numpy as jnp
    >>> out = reachable_half(jnp.float32(1.0), jnp.float32(1.5), jnp.bfloat16)
    >>> float(out.half), float(out.update)
    (1.5, 0.5)
  """
  old = old_half.astype(jnp.float32)
  target = new_master.astype(half_dtype).astype(jnp.float32)
  update = target - old
  reached = (old + update).astype(half_dtype)  # exactly what optax does
  reached32 = reached.astype(jnp.float32)
  master = jnp.where(reached32 == target, new_master, reached32)
  if np.dtype(half_dtype) == np.dtype(jnp.bfloat16):
    # Off exact ties, so that (params, low 16 bits) is the master, exactly:
    # master="remainder" keeps only those (see jmp_lab.remainder).
    master = untie(master)
  return ReachableHalf(master, reached, update)


__all__ = [
    "join",
    "reachable_half",
    "ReachableHalf",
    "split",
    "untie",
]
