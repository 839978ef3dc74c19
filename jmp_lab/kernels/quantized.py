"""Adam's moments in 8 bits: block-wise scales, and the maps every backend
computes on loaded values.

A quantized moment is a :class:`QuantizedMoment`: ``codes``, one byte an
element in the param's shape, and ``scales``, one fp32 number a block of
``block`` consecutive elements along the last axis (``param.shape[:-1] +
(last // block,)``). Blocks run along the last axis, so a param sharded on
any axis (FSDP, tensor parallelism) splits its codes and scales alike, and
no block straddles a shard as long as each shard's last axis is a multiple
of the block; :func:`block_size` picks the largest of 256, 128, 64 or 32
that divides the last axis.

The maps (chosen in ``docs/guides/optimizers.md``, "8-bit states", from the
measurements in ``benchmarks/quantized_moments.py``):

* ``"int8"``: the first moment as ``A * sign(q) * (|q| / 127) ** 4`` (int8
  ``q``, ``A`` the block's largest ``|mu|``): a power law, so small values
  keep resolution near zero (the smallest code is 8.4 decades under ``A``;
  the steps near ``A`` are 3%), as bitsandbytes' dynamic map does, in a
  closed form a kernel computes in registers (two square roots). The
  second moment's square root the same way on 255 levels,
  ``nu = (S * (q / 255) ** 4) ** 2`` (uint8 ``q``, ``S`` the block's
  largest ``sqrt(nu)``): 19 decades of ``nu`` in one block.
* ``"float8_e4m3fn"``: the first moment as ``e4m3(mu * 448 / A)``, the
  second as ``e4m3(sqrt(nu) * 448 / S)`` (its square root again, as
  torchao's FP8 moments keep their range).

A positive second moment never dequantizes to zero: its code is at least the
smallest non-zero one (``rsqrt(nu)`` would blow the update up). The smallest
code overstates a tiny ``nu``, which only shortens that element's step.
Leaves too small to be worth a scale (fewer than :data:`MIN_ELEMENTS`
elements, as bitsandbytes' ``min_8bit_size``) or whose last axis no block
divides keep fp32 moments: :func:`quantizable`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: The quantized moment kinds ``fused_adamw`` and
#: :func:`jmp_lab.optim.scale_by_quantized_adam` take.
KINDS = ("int8", "float8_e4m3fn")

#: Block sizes, largest first: each block is this many elements along the
#: last axis, with one fp32 scale.
BLOCK_SIZES = (256, 128, 64, 32)

#: Smaller leaves keep fp32 moments (bitsandbytes' ``min_8bit_size``).
MIN_ELEMENTS = 4096

_FP8 = jnp.float8_e4m3fn
_FP8_MAX = 448.0
# e4m3fn's smallest subnormal: a positive nu is never stored below it.
_FP8_TINY = 2.0 ** -9


class QuantizedMoment(NamedTuple):
  """One leaf's quantized moment: ``codes`` like the param, ``scales``
  ``param.shape[:-1] + (blocks,)`` in fp32."""

  codes: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The param's shape (so layout code that matches arrays to params by
    shape finds the moment)."""
    return tuple(self.codes.shape)

  @property
  def block(self) -> int:
    return self.codes.shape[-1] // self.scales.shape[-1]


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedMoment)


def kind_of(dtype: Any) -> str | None:
  """``"int8"`` or ``"float8_e4m3fn"`` for a quantized moment dtype
  (a name, ``"fp8"``, or the numpy/jnp dtype), else None."""
  if isinstance(dtype, str) and dtype in ("int8", "fp8", "float8_e4m3fn"):
    return "int8" if dtype == "int8" else "float8_e4m3fn"
  try:
    parsed = np.dtype(dtype)
  except TypeError:
    return None
  if parsed == np.dtype(jnp.int8):
    return "int8"
  if parsed == np.dtype(_FP8):
    return "float8_e4m3fn"
  return None


def block_size(shape: tuple[int, ...]) -> int | None:
  """The block of a leaf of ``shape``: the largest of :data:`BLOCK_SIZES`
  dividing its last axis, or None."""
  if not shape:
    return None
  return next((b for b in BLOCK_SIZES if shape[-1] % b == 0), None)


def blocks_cut(name: str, shape: tuple[int, ...], block: int, spec: Any,
               mesh: Any) -> str | None:
  """Why a ``PartitionSpec`` that splits a quantized leaf's last axis
  (blocks of ``block``) cuts blocks in two, or None where every shard holds
  whole blocks. Each device quantizes its own shard, so a block split
  between two devices would get two scales where the state holds one.
  ``name``: the leaf, as the message names it."""
  entry = spec[len(shape) - 1] if len(spec) >= len(shape) else None
  axes = () if entry is None else (
      entry if isinstance(entry, tuple) else (entry,))
  shards, width = math.prod(mesh.shape[a] for a in axes), shape[-1]
  if shards <= 1 or (width % shards == 0 and (width // shards) % block == 0):
    return None
  blocks = width // block
  whole = [n for n in range(2, blocks + 1) if blocks % n == 0][:6]
  return (
      f"{name}: its 8-bit moments are quantized in blocks of {block} along "
      f"the last axis ({width} wide), but the sharding {spec} splits that "
      f"axis into {shards} shards of {width / shards:g}, which would cut "
      f"blocks in two. Split the last axis into a number of shards that "
      f"leaves whole blocks ({', '.join(map(str, whole)) or 'none but 1'}), "
      f"shard another axis, or keep 16-bit moments "
      f"(mu_dtype/nu_dtype=\"bfloat16\") for this model.")


def quantizable(shape: tuple[int, ...]) -> bool:
  """Whether a leaf of ``shape`` gets 8-bit moments (else fp32)."""
  return math.prod(shape) >= MIN_ELEMENTS and block_size(shape) is not None


def zeros(shape: tuple[int, ...], kind: str, second: bool,
          like: Any = None) -> QuantizedMoment:
  """A zero moment. ``like`` (an array of ``shape``): codes placed as it is
  (a sharded param gives sharded codes)."""
  block = block_size(shape)
  code_dtype = _code_dtype(kind, second)
  codes = (jnp.zeros_like(like, code_dtype) if like is not None
           else jnp.zeros(shape, code_dtype))
  return QuantizedMoment(codes, jnp.zeros(shape[:-1] + (shape[-1] // block,),
                                          jnp.float32))


def _code_dtype(kind: str, second: bool):
  if kind == "int8":
    return jnp.uint8 if second else jnp.int8
  return _FP8


def _per_element(per_block: jax.Array) -> jax.Array:
  return per_block[..., None]


def blocked(x: jax.Array, block: int) -> jax.Array:
  """``x`` as ``(..., blocks, block)`` (a free reshape)."""
  return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def dequantize(codes: jax.Array, scales: jax.Array, kind: str,
               second: bool, broadcast=None) -> jax.Array:
  """fp32 values from ``codes`` (``(..., block)``) and their block's
  ``scales`` (``(...)``).

  ``broadcast`` spreads the scales over their blocks' elements (default
  ``scales[..., None]``); a kernel passes its own where the register layout
  must be named (Mosaic GPU)."""
  scale = (broadcast or _per_element)(scales)
  # Widened first: Mosaic GPU computes on 16- and 32-bit values only.
  q = codes.astype(jnp.float32)
  if kind == "int8":
    # root = S * u**4 (u = |q| / 127 or q / 255); nu = root**2, mu = root.
    u = q * (1 / 255 if second else 1 / 127)
    u2 = u * u
    root = scale * (u2 * u2)
    if second:
      return root * root
    return jnp.where(q < 0, -root, root)
  root = scale * (q * (1 / _FP8_MAX))
  return root * root if second else root


def quantize(x: jax.Array, kind: str, second: bool, broadcast=None, sqrt=jnp.sqrt
             ) -> tuple[jax.Array, jax.Array]:
  """``(codes, scales)`` of fp32 ``x`` (``(..., block)``): each block
  scaled by its largest magnitude (of ``sqrt(x)`` for the second moment).

  A non-zero second moment gets a non-zero code. Only the operations a
  Pallas kernel lowers (square roots, a max, a cast), so the kernels
  quantize in registers. ``broadcast`` as in :func:`dequantize`; ``sqrt``
  the square root to use (Mosaic GPU lowers ``rsqrt`` only and passes
  ``x * rsqrt(x)``)."""
  root = sqrt(x) if second else x
  magnitude = jnp.abs(root)
  scale = jnp.max(magnitude, axis=-1)
  inverse = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1), 0)
  unit = magnitude * (broadcast or _per_element)(inverse)     # in [0, 1]
  if kind == "int8":
    levels = 255.0 if second else 127.0
    # Rounded half up; a truncating cast of a non-negative value is its
    # floor (Mosaic GPU lowers the cast, not floor).
    code = (levels * sqrt(sqrt(unit)) + 0.5).astype(jnp.int32)
    if second:
      code = jnp.where(x > 0, jnp.maximum(code, 1), 0)
      return code.astype(jnp.uint8), scale
    return jnp.where(root < 0, -code, code).astype(jnp.int8), scale
  scaled = unit * _FP8_MAX
  if second:
    scaled = jnp.where(x > 0, jnp.maximum(scaled, _FP8_TINY), 0)
  else:
    scaled = jnp.where(root < 0, -scaled, scaled)
  return scaled.astype(_FP8), scale


def load(moment: QuantizedMoment, kind: str, second: bool) -> jax.Array:
  """A whole leaf's moment in fp32, shaped ``(..., blocks, block)``."""
  return dequantize(blocked(moment.codes, moment.block), moment.scales, kind,
                    second)


def store(values: jax.Array, kind: str, second: bool) -> QuantizedMoment:
  """``values`` (``(..., blocks, block)`` fp32) quantized, in the leaf's
  shape."""
  codes, scales = quantize(values, kind, second)
  return QuantizedMoment(codes.reshape(codes.shape[:-2] + (-1,)), scales)


__all__ = [
    "BLOCK_SIZES",
    "block_size",
    "blocked",
    "dequantize",
    "is_quantized",
    "kind_of",
    "KINDS",
    "load",
    "MIN_ELEMENTS",
    "quantizable",
    "quantize",
    "QuantizedMoment",
    "store",
    "zeros",
]
