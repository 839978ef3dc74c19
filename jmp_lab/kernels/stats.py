"""The gradient statistics every update reads: the finite flag and the sum
of squares, defined once.

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
]
