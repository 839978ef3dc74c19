"""Half params and their fp32 master, exactly: the remainder and the landing.

The fp32 master as bf16 params plus a 16-bit remainder (``master="remainder"``).

An fp32 number is 32 bits; bf16 is its upper 16, rounded to nearest even.
Keeping the lower 16 bits beside the bf16 params (Transformer Engine's
``store_param_remainders``) gives back the fp32 master exactly, at 2 bytes per
parameter instead of 4:

* :func:`split` -- ``master -> (cast(master) as bf16, lower 16 bits)``;
* :func:`join` -- the inverse: if the lower bits are at least half a bf16 ulp,
  rounding went up, so the upper bits are the param's minus one.

The one value the pair cannot tell apart is an exact tie (lower bits
``0x8000``), which round-to-nearest-even sends down or up depending on the
upper bits. :func:`untie` moves such a master by one fp32 ulp towards the bf16
value it rounds to (same param, no tie). Every jmp_lab optimizer applies it to
every bf16 master it writes (:func:`reachable_half`), in the
``"float32"`` mode too, so the two modes follow the same trajectory bit for
bit. The move is 2**-24 relative, in one update in 65,536.

Example::

  >>> import jax.numpy as jnp
  >>> master = jnp.array([1.0 + 2.0**-20, -3.14159], jnp.float32)
  >>> params, rem = split(master)
  >>> params.dtype, rem.dtype
  (dtype(bfloat16), dtype('uint16'))
  >>> bool(jnp.all(join(params, rem) == master))
  True

:func:`reachable_half` is the one piece of arithmetic that keeps half params
equal to ``cast(master)``. ``optax.apply_updates`` computes ``(p + u).astype(p.dtype)`` in fp32. With
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

from jmp_lab.kernels.remainder import (
    join,
    reachable_half,
    ReachableHalf,
    split,
    untie,
)

__all__ = [
    "join",
    "reachable_half",
    "ReachableHalf",
    "split",
    "untie",
]
