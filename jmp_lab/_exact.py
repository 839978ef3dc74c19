"""The one piece of arithmetic that keeps half params equal to cast(master).

``optax.apply_updates`` computes ``(p + u).astype(p.dtype)`` in fp32. With
``u = cast(m) - p`` that lands exactly on ``cast(m)`` unless the param moves
across many binades in one step (a value landing very near zero, e.g. on a
sign change): then ``u`` rounds in fp32 and ``p + u`` rounds to a neighbour of
``cast(m)``. No fp32 ``u`` reaches ``cast(m)`` there, so the master is snapped
to the half value that ``p + u`` does reach. The snap moves the master by a
few fp32 ulps of the old param -- the size of the master update's own rounding
-- and only in the elements that need it. A bf16 master is also kept off exact
bf16 ties (:func:`jmp_lab.remainder.untie`, one fp32 ulp).

Element-wise jnp only, so that every kernel backend can call it on loaded
values as well as the tree optimizer on whole leaves.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab import remainder


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
    master = remainder.untie(master)
  return ReachableHalf(master, reached, update)
