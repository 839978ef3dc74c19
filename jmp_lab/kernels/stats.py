"""The gradient statistics every update reads: the finite flag and the sum
of squares, defined once; and the maxima in parts that fp8's amaxes are
read as.

The optimizers' gate (:mod:`jmp_lab._src.optim.gate`), the public
:func:`jmp_lab.all_finite`, the kernels' jnp reference and their partitioned
step all build on these; the Pallas kernels compute the same flag in
registers (``min(isfinite)`` over their tiles).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

Axes = Optional[Union[str, Sequence[str]]]


# XLA GPU's longest row reduction that it compiles into one kernel
# (ReductionIsRaceFree: 1,024 threads x 16 elements).
_ONE_KERNEL_ROW = 16384


def part_maxima(x: jax.Array, parts: int) -> Optional[jax.Array]:
  """``|x|``'s maxima over ``parts`` equal parts (fp32), or None where
  ``x`` does not split so: an fp8 tensor's amax, left for a later
  reduction of all tensors' parts at once (:func:`jmp_lab.fp8.next_meta`).

  The parts split one axis of ``x`` (its first where that divides, else
  its last) and keep every other axis whole, so an axis that is sharded
  across devices (a weight's FSDP axis, an activation's tensor-parallel
  features) is not merged with another, which would make XLA gather the
  tensor in 16 bits before reducing it. Where neither axis divides, the
  parts are the flattened tensor's. Split by its first axis, each part is
  at most 16,384 elements long, or read as up to 8 strided chunks when it
  is longer (a reduction over ``(chunks, parts, ...)``'s first and
  trailing axes): XLA splits a longer row reduction into two kernels, and
  keeps one whose reduced major axis is at most 8 in one (its race-free
  bounds), so the quantizing kernel computes the parts.

  >>> import jax.numpy as jnp
  >>> part_maxima(jnp.arange(-8.0, 8.0).reshape(4, 4), 2).tolist()
  [8.0, 7.0]
  """
  if x.ndim == 0 or x.size < parts:
    return None
  magnitude = jnp.abs(x)
  first, last = x.shape[0], x.shape[-1]
  if first % parts == 0:
    per_part = x.size // parts
    chunks = next((c for c in range(1, 9) if (first // parts) % c == 0
                   and per_part // c <= _ONE_KERNEL_ROW), 1)
    blocks = magnitude.reshape(chunks, parts, first // (chunks * parts),
                               *x.shape[1:])
    kept = 1
  elif last % parts == 0:
    blocks = magnitude.reshape(*x.shape[:-1], parts, last // parts)
    kept = x.ndim - 1
  elif x.size % parts == 0:
    blocks, kept = magnitude.reshape(parts, -1), 0
  else:
    return None
  reduced = tuple(a for a in range(blocks.ndim) if a != kept)
  return jnp.max(blocks, axis=reduced).astype(jnp.float32)


def finite(value) -> jax.Array:
  """Whether every element of ``value`` is finite, as a scalar bool."""
  return jnp.all(jnp.isfinite(value))


def all_finite(values: Sequence, flags: Sequence = ()) -> jax.Array:
  """Whether every element of every array in ``values`` is finite and every
  scalar bool in ``flags`` is True (True when there are none)."""
  checks = [finite(v) for v in values] + [jnp.asarray(f, bool) for f in flags]
  if len(checks) == 1:
    return checks[0]
  return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def agree(flag: jax.Array, axes: Axes) -> jax.Array:
  """``flag`` combined over the mapped ``axes`` (inside ``shard_map``): one
  device's False makes every device's False. A ``pmin`` over {0, 1}."""
  if not axes:
    return flag
  return jax.lax.pmin(flag.astype(jnp.int32), axes).astype(bool)


def grad_stats(grads: Sequence, scale) -> tuple[jax.Array, jax.Array]:
  """``(sum of squares of g / scale, whether every g / scale is finite)``
  over a list of gradient leaves, in jnp (a reduction per leaf): the
  reference of the multi-tensor statistics kernel."""
  unscaled = [g.astype(jnp.float32) / scale for g in grads]
  sumsq = sum((jnp.sum(g * g) for g in unscaled), jnp.float32(0))
  return sumsq, all_finite(unscaled)


__all__ = [
    "agree",
    "all_finite",
    "finite",
    "grad_stats",
    "part_maxima",
]
