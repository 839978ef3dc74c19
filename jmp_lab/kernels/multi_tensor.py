"""The fused AdamW update over the leaves as they are: multi-tensor kernels.

apex's ``multi_tensor_apply`` design in Pallas: one kernel launch covers many
leaves of the params (``LEAVES_PER_LAUNCH``), with no packing into a flat
buffer. Each kernel program handles one ``BLOCK`` of one leaf; the static
table of where each leaf's blocks start tells a program which leaf it is on,
and each leaf's code is a conditional block of its own.

Two kernels make one step:

1. :func:`grad_stats` reads every gradient once and writes, per
   ``STATS_BLOCKS`` blocks, the sum of squares of the unscaled gradient and
   whether those blocks are finite (partial results, summed by XLA in a
   fixed order, so runs repeat);
2. :func:`update` reads g, p, m, v and writes p, m, v (in place, aliased to
   the inputs) and the half copy; on a non-finite step it writes only the
   half copy. With a remainder it also reads and writes the remainder; with
   no master, p is the half params.

Bytes per parameter, bf16 gradients, compiled for an H100 and checked in
``tests/test_compiled.py`` (statistics pass + update reads + update writes;
moments fp32 unless stated):

=============================================  =====  =====  ======  =====
mode                                           stats  read   write   total
=============================================  =====  =====  ======  =====
fp32 master, half params (bf16-o2)             2      14     14      30
fp32 params (they are the master)              4*     16     12      32*
``master="remainder"``                         2      14     12      28
``master="remainder"``, bf16 moments           2      10     8       20
``master="none"`` (nearest or stochastic)      2      12     10      24
``master="none"``, bf16 moments                2      8      6       16
=============================================  =====  =====  ======  =====

(*) fp32 gradients: the statistics read 4 B. ``backend="auto"`` keeps XLA's
own per-leaf fusion there, which reads the bf16 GEMM outputs directly
(:func:`jmp_lab.kernels.tree_backend`). XLA's fusion of
``mixed_precision(optax.adamw)`` with an fp32 master is measured against
these in ``benchmarks/RESULTS.md``. Stochastic rounding costs arithmetic (an integer
hash per element, :func:`jmp_lab.rounding.counter_bits`), no bytes.

Backends: ``"triton"`` (Pallas' Triton lowering) and ``"interpret"`` (the
same kernels in Pallas interpret mode, on any device; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jmp_lab.kernels import quantized, remainder, rounding
from jmp_lab.kernels.reference import (CLIP, FINITE, INV_BIAS1, INV_BIAS2, LR,
                                       SCALE, SEED, AdamWConfig,
                                       Outputs, adamw_elementwise)

# Leaves per kernel launch. Each leaf is a conditional block of its own in
# the kernel, and Triton's compile time grows faster than linearly with
# their number (compiled for an H100, both kernels: 6-8 s for 16 leaves, 24 s
# for 48, about 200 s for 150); GPT-2-small's 197 leaves take 13 launches of
# each kernel.
LEAVES_PER_LAUNCH = 16

# Elements per kernel program: large enough that the per-program overhead
# (finding the leaf) is noise, small enough that the last, partial block of
# each leaf wastes little.
BLOCK = 2048

# Blocks that one statistics program sums. The partial results then number
# about a 32nd of the blocks (2,610 for GPT-2-small), which XLA sums in one
# kernel; one partial per block (79,718) took it two.
STATS_BLOCKS = 32


@dataclasses.dataclass(frozen=True)
class Segments:
  """The static plan of a multi-tensor launch.

  Attributes:
    sizes: elements of each leaf (the kernels see them flattened).
    decays: whether each leaf is weight-decayed.
    first_leaf: the number of this launch's first leaf among all of them
      (the stochastic-rounding stream of leaf ``i`` is ``first_leaf + i``),
      unless ``leaf_ids`` names each leaf's number.
    quant_blocks: for a launch of 8-bit moments, each leaf's block (its
      operands are then ``(rows, block)`` views; a program handles
      ``BLOCK // block`` rows, so a block's scale is computed in registers).
    shard_shapes, global_shapes: for shards of leaves, their shapes and the
      whole leaves' (stochastic rounding draws by the index in the whole
      leaf, from a base index the scalars carry after the flags).
  """

  sizes: tuple[int, ...]
  decays: tuple[bool, ...]
  first_leaf: int = 0
  leaf_ids: Optional[tuple[int, ...]] = None
  quant_blocks: Optional[tuple[int, ...]] = None
  # Elements one program handles.
  block: int = BLOCK
  # When the leaves are shards (stochastic rounding under a sharded state):
  # each leaf's shard shape and whole shape; its base index is a scalar slot.
  shard_shapes: Optional[tuple[tuple[int, ...], ...]] = None
  global_shapes: Optional[tuple[tuple[int, ...], ...]] = None

  def leaf_id(self, i: int) -> int:
    """Leaf ``i``'s number among all leaves (its rounding stream)."""
    return (self.leaf_ids[i] if self.leaf_ids is not None
            else self.first_leaf + i)

  @property
  def block_starts(self) -> tuple[int, ...]:
    """The first program of each leaf."""
    return tuple(int(x) for x in np.cumsum((0,) + self.blocks)[:-1])

  @property
  def blocks(self) -> tuple[int, ...]:
    return tuple(-(-size // self.block) for size in self.sizes)

  @property
  def total_blocks(self) -> int:
    return sum(self.blocks)


def _compiler_params(interpret: bool):
  # 8 warps: 8 elements a thread. Compiled for sm_90a the update kernel then
  # needs 60-64 registers in every mode; with 4 warps it needed 114-122 and
  # spilled with a remainder and bf16 moments.
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton  # GPU builds only
  return pltriton.CompilerParams(num_warps=8, num_stages=1)


def _masked_io():
  """``(load, store)`` with masks: Triton's in a kernel, which interpret mode
  also runs."""
  from jax.experimental.pallas import triton as pltriton
  return pltriton.load, pltriton.store


def _chunks(n: int) -> list[range]:
  """The leaves of each kernel launch (see ``LEAVES_PER_LAUNCH``)."""
  return [range(lo, min(lo + LEAVES_PER_LAUNCH, n))
          for lo in range(0, n, LEAVES_PER_LAUNCH)]


def _for_each_leaf(program, segments: Segments, body: Callable[[int], None]):
  """Runs ``body(i)`` for the one leaf whose blocks include ``program``.

  A flat run of conditionals, each holding its leaf's whole body. Sharing
  the arithmetic across leaves (values flowing in or out of per-leaf
  conditionals, or a balanced tree of them) made Triton's compile time grow
  with the square of the leaf count; self-contained bodies grow linearly.
  """
  for i, (start, blocks) in enumerate(zip(segments.block_starts,
                                          segments.blocks)):
    pl.when((program >= start) & (program < start + blocks))(
        functools.partial(body, i))


def _block(program, segments: Segments, i: int):
  """Leaf ``i``'s slice, mask and element indices for this program (and
  the mask of its quantization blocks' rows, or None)."""
  if segments.quant_blocks is not None:
    block = segments.quant_blocks[i]
    rows = BLOCK // block
    row0 = (program - segments.block_starts[i]) * rows
    row = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
    index = row * block + lane
    row_mask = row0 + jax.lax.broadcasted_iota(
        jnp.int32, (rows,), 0) < segments.sizes[i] // block
    return pl.ds(row0, rows), index < segments.sizes[i], index, row_mask
  offset = (program - segments.block_starts[i]) * BLOCK
  index = offset + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
  return pl.ds(offset, BLOCK), index < segments.sizes[i], index, None


def _stats_kernel(segments: Segments, scale_ref, *refs):
  grads, (sumsq_out, finite_out) = refs[:-2], refs[-2:]
  load, _ = _masked_io()
  # Read outside pl.when: interpret mode only substitutes the program id at
  # the kernel's top level.
  program = pl.program_id(0)
  scale = scale_ref[0]

  def leaf_stats(i):
    first = (program - segments.block_starts[i]) * segments.block

    def add_block(j, carry):
      sumsq, finite = carry
      index = first + j * BLOCK + jax.lax.broadcasted_iota(
          jnp.int32, (BLOCK,), 0)
      # Unscaled as the optimizers unscale: the flag and the norm are theirs.
      # (A block past the leaf's end is all masked: it reads nothing.)
      g = load(grads[i].at[pl.ds(first + j * BLOCK, BLOCK)],
               mask=index < segments.sizes[i], other=0)
      g = g.astype(jnp.float32) / scale
      # A min, not jnp.all: Triton has no boolean reduction.
      return (sumsq + jnp.sum(g * g),
              jnp.minimum(finite, jnp.min(jnp.isfinite(g).astype(jnp.int32))))

    sumsq, finite = jax.lax.fori_loop(0, STATS_BLOCKS, add_block,
                                      (jnp.float32(0), jnp.int32(1)))
    sumsq_out[...] = jnp.full((1,), sumsq, jnp.float32)
    finite_out[...] = jnp.full((1,), finite, jnp.int32)

  _for_each_leaf(program, segments, leaf_stats)


def _launch_stats(grads: Sequence[jax.Array], scale: jax.Array, *,
                  interpret: bool) -> tuple[jax.Array, jax.Array]:
  segments = Segments(tuple(g.size for g in grads), (False,) * len(grads),
                      block=STATS_BLOCKS * BLOCK)
  per_block = pl.BlockSpec((1,), lambda i: (i,))
  return pl.pallas_call(
      functools.partial(_stats_kernel, segments),
      out_shape=[jax.ShapeDtypeStruct((segments.total_blocks,), jnp.float32),
                 jax.ShapeDtypeStruct((segments.total_blocks,), jnp.int32)],
      grid=(segments.total_blocks,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,))]
      + [pl.no_block_spec] * len(grads),
      out_specs=[per_block, per_block],
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="jmp_lab_grad_stats",
  )(scale, *[g.reshape(-1) for g in grads])


def grad_stats(grads: Sequence[jax.Array], scale: jax.Array, *,
               interpret: bool) -> tuple[jax.Array, jax.Array]:
  """``(sum of squares of g / scale, whether every g / scale is finite)``.

  One kernel launch per ``LEAVES_PER_LAUNCH`` leaves writes a partial result
  per ``STATS_BLOCKS`` blocks; XLA sums them in a fixed order, so runs are
  reproducible.
  """
  scale = jnp.reshape(scale, (1,)).astype(jnp.float32)
  partials = [_launch_stats([grads[i] for i in chunk], scale,
                            interpret=interpret)
              for chunk in _chunks(len(grads))]
  sumsq = jnp.concatenate([s for s, _ in partials])
  finite = jnp.concatenate([f for _, f in partials])
  return jnp.sum(sumsq), jnp.all(finite == 1)


# The update's scalars travel as one int32 array (see ``_pack_scalars``): the
# hyperparameters' float bits, then the flags.
_HYPER_SLOTS = 8
_FLAG_SLOTS = 8


def _pack_scalars(hyper: jax.Array, flags: jax.Array) -> jax.Array:
  """``hyper`` (f32) and ``flags`` (i32) as one i32[16] array: XLA computes
  the step's scalars in one kernel, where it compiled two arrays (f32[8],
  s32[4]) as two. Floats travel as their bits, so nothing on the way can
  flush or canonicalise them."""
  bits = jax.lax.bitcast_convert_type(hyper.astype(jnp.float32), jnp.int32)
  return jnp.concatenate([
      jnp.pad(bits, (0, _HYPER_SLOTS - bits.shape[0])),
      jnp.pad(flags.astype(jnp.int32), (0, _FLAG_SLOTS - flags.shape[0]))])


def _leaf_index(scalars_ref, segments: Segments, i: int, index):
  """The elements' indices in leaf ``i`` whole (``index`` if it is whole)."""
  if segments.global_shapes is None:
    return index
  base = scalars_ref[_HYPER_SLOTS + _FLAG_SLOTS + i]
  return rounding.global_index(index, segments.shard_shapes[i],
                               segments.global_shapes[i], base)


@dataclasses.dataclass(frozen=True)
class _Groups:
  """How a launch's leaf operands are grouped: a moment is one group (an
  array a leaf) or two (8-bit: codes, then scales)."""

  remainder: bool
  direct: bool
  extra: bool
  mu_quantized: bool
  nu_quantized: bool

  def split(self, groups: list) -> dict:
    it = iter(groups)
    take = lambda k: tuple(next(it) for _ in range(k))  # noqa: E731
    mu_n, nu_n = 1 + self.mu_quantized, 1 + self.nu_quantized
    named = dict(g=next(it), p=next(it))
    named["rem"] = next(it) if self.remainder else None
    named["mu"], named["nu"] = take(mu_n), take(nu_n)
    named["p_out"] = next(it)          # the remainder out, with one
    named["mu_out"], named["nu_out"] = take(mu_n), take(nu_n)
    named["half_out"] = next(it) if self.remainder else None
    named["extra_out"] = next(it) if self.extra else None
    return named


def _load_moment(config, refs, i, where, mask, row_mask, load, second):
  """A leaf's moment in fp32 (an 8-bit one dequantized in registers)."""
  kind = config.quant_kind(second)
  if len(refs) == 1:
    return load(refs[0][i].at[where], mask=mask, other=0)
  # (A float zero for fp8 codes: Triton cannot cast an integer fill to fp8.)
  fill = 0 if jnp.issubdtype(refs[0][i].dtype, jnp.integer) else 0.0
  codes = load(refs[0][i].at[where], mask=mask, other=fill)
  scales = load(refs[1][i].at[where], mask=row_mask, other=0.0)
  return quantized.dequantize(codes, scales, kind, second)


def _store_moment(config, refs, i, where, mask, row_mask, value, store,
                  second):
  """A leaf's new moment, quantized in registers when 8-bit."""
  if len(refs) == 1:
    store(refs[0][i].at[where], value.astype(refs[0][i].dtype), mask=mask)
    return
  kind = config.quant_kind(second)
  codes, scales = quantized.quantize(value, kind, second)
  store(refs[0][i].at[where], codes, mask=mask)
  store(refs[1][i].at[where], scales, mask=row_mask)


def _update_kernel(config: AdamWConfig, segments: Segments, grouping: _Groups,
                   scalars_ref, *refs):
  n = len(segments.sizes)
  # In: g, p (the half params with a remainder or no master), [remainder],
  # mu, nu. Out (aliased): p (or the remainder), mu, nu, [half]; then the
  # extra output (a fresh buffer) when asked.
  r = grouping.split([refs[k * n:(k + 1) * n]
                      for k in range(len(refs) // n)])
  extra_out = r["extra_out"]
  load, store = _masked_io()
  # Read outside pl.when: interpret mode only substitutes the program id at
  # the kernel's top level.
  program = pl.program_id(0)
  finite = scalars_ref[_HYPER_SLOTS + FINITE] == 1
  seed = jax.lax.bitcast_convert_type(scalars_ref[_HYPER_SLOTS + SEED],
                                      jnp.uint32)
  hyper = tuple(jax.lax.bitcast_convert_type(scalars_ref[k], jnp.float32)
                for k in (LR, INV_BIAS1, INV_BIAS2, SCALE, CLIP))

  def leaf_update(i):
    where, mask, index, row_mask = _block(program, segments, i)
    if config.remainder:
      p_ = remainder.join(load(r["p"][i].at[where], mask=mask, other=0),
                          load(r["rem"][i].at[where], mask=mask, other=0))
    else:
      p_ = load(r["p"][i].at[where], mask=mask, other=0)

    @pl.when(finite)
    def _update():
      g_ = load(r["g"][i].at[where], mask=mask, other=0)
      mu_, nu_ = (_load_moment(config, r[k], i, where, mask, row_mask, load,
                               k == "nu") for k in ("mu", "nu"))
      bits = (rounding.counter_bits(seed, segments.leaf_id(i),
                                    _leaf_index(scalars_ref, segments, i,
                                                index))
              if config.stochastic else None)
      out = adamw_elementwise(config, g_, p_, mu_, nu_,
                              jnp.bool_(segments.decays[i]), *hyper,
                              bits=bits)
      for k, value in (("mu_out", out.mu), ("nu_out", out.nu)):
        _store_moment(config, r[k], i, where, mask, row_mask, value, store,
                      k == "nu_out")
      if config.remainder:
        targets = (r["p_out"], r["half_out"])
        values = (remainder.split(out.master)[1], out.extra)
      else:
        targets = (r["p_out"],) + ((extra_out,) if extra_out else ())
        values = (out.master, out.extra)
      for target, value in zip(targets, values):
        store(target[i].at[where], value.astype(target[i].dtype), mask=mask)

    if extra_out is not None:
      @pl.when(jnp.logical_not(finite))
      def _skip():
        # p, m and v are aliased to their inputs: not writing them keeps
        # them. The extra output is a fresh buffer and must hold the old
        # values. (With a remainder every output is aliased.)
        old = (jnp.zeros_like(p_) if config.half_dtype is None
               else p_.astype(config.half_dtype))
        store(extra_out[i].at[where], old, mask=mask)

  _for_each_leaf(program, segments, leaf_update)


def _launch_update(config: AdamWConfig, segments: Segments, inputs, scalars,
                   *, write_extra: bool, interpret: bool):
  """One launch over ``inputs`` (lists of leaves: g, p, mu, nu; or g, half,
  remainder, mu, nu; an 8-bit moment as two lists, codes and scales). The
  state's leaves are updated in place."""
  n = len(inputs[0])
  mu_q, nu_q = (segments.quant_blocks is not None and quantized.is_quantized(
      group[0]) for group in inputs[-2:])
  moments = []
  for group, is_q in zip(inputs[-2:], (mu_q, nu_q)):
    moments += ([[m.codes for m in group], [m.scales for m in group]]
                if is_q else [group])
  inputs = inputs[:-2] + moments
  extra = write_extra and not (config.remainder or config.direct)
  grouping = _Groups(config.remainder, config.direct, extra, mu_q, nu_q)
  leading = 3 if config.remainder else 2      # g, p, [remainder]
  if config.remainder:
    updated = inputs[2:] + inputs[1:2]     # remainder, moments, half
  else:
    updated = inputs[1:2] + inputs[leading:]  # p, moments

  def view(x, i):
    """The kernel's view of a leaf operand: flat, or ``(rows, block)``
    rows for 8-bit moments (scales stay one a row)."""
    if segments.quant_blocks is None:
      return x.reshape(-1)
    block = segments.quant_blocks[i]
    rows = segments.sizes[i] // block
    return x.reshape(rows) if x.size == rows else x.reshape(rows, block)

  out_shape = [jax.ShapeDtypeStruct(view(x, i).shape, x.dtype)
               for group in updated for i, x in enumerate(group)]
  if extra:
    extra_dtype = (jnp.float32 if config.half_dtype is None
                   else config.half_dtype)
    out_shape += [jax.ShapeDtypeStruct(view(x, i).shape, extra_dtype)
                  for i, x in enumerate(inputs[0])]
  position = {id(group): k for k, group in enumerate(inputs)}
  aliases = {1 + position[id(group)] * n + i: k * n + i
             for k, group in enumerate(updated) for i in range(n)}
  return pl.pallas_call(
      functools.partial(_update_kernel, config, segments, grouping),
      out_shape=out_shape,
      grid=(segments.total_blocks,),
      in_specs=[pl.BlockSpec(scalars.shape, lambda i: (0,))]
      + [pl.no_block_spec] * (len(inputs) * n),
      out_specs=[pl.no_block_spec] * len(out_shape),
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="jmp_lab_multi_tensor_adamw",
  )(scalars, *[view(x, i) for group in inputs for i, x in enumerate(group)])


def update(config: AdamWConfig, decays: Sequence[bool],
           g: Sequence[jax.Array], p: Sequence[jax.Array],
           mu: Sequence[jax.Array], nu: Sequence[jax.Array], hyper: jax.Array,
           flags: jax.Array, *, write_extra: bool, interpret: bool,
           remainders: Optional[Sequence[jax.Array]] = None,
           index_maps=None) -> Outputs:
  """One fused AdamW step over lists of leaves (see ``reference``).

  ``p`` (or, with ``config.remainder``, the bf16 params and ``remainders``),
  ``mu`` and ``nu`` are updated in place (donate them to make it real).
  Without ``write_extra`` the fourth output is None: the caller needs
  neither the half copy nor the fp32 update (fp32 params, new-params path).
  With ``config.direct`` (no master) ``p`` are the half params, updated in
  place, and the fourth output is None; stochastic rounding needs the seed
  in ``flags[SEED]``.
  Moments are stored in the dtype they come in (fp32 or bf16). With
  ``index_maps`` (a ``(global shape, base)`` per leaf) the leaves are shards,
  and stochastic rounding draws by each element's index in its whole leaf.
  """
  # (Padded to a power of two, as Triton blocks must be.)
  scalars = _pack_scalars(hyper, flags)
  groups = [g, p] + ([remainders] if config.remainder else []) + [mu, nu]
  kinds = 3 if config.direct else (
      4 if (write_extra or config.remainder) else 3)
  results: list[dict] = [{} for _ in range(kinds)]
  for chunk in _launches(mu, nu):
    segments = Segments(
        tuple(p[i].size for i in chunk),
        tuple(bool(decays[i]) for i in chunk), leaf_ids=tuple(chunk),
        quant_blocks=_quant_blocks(mu[chunk[0]], nu[chunk[0]], chunk, mu, nu))
    launch_scalars = scalars
    if index_maps is not None and config.stochastic:
      segments = dataclasses.replace(
          segments, shard_shapes=tuple(tuple(p[i].shape) for i in chunk),
          global_shapes=tuple(tuple(index_maps[i][0]) for i in chunk))
      # One base slot per leaf of the launch, after the flags.
      bases = jnp.stack([jnp.asarray(index_maps[i][1], jnp.int32)
                         for i in chunk])
      slots = 1 << (LEAVES_PER_LAUNCH - 1).bit_length()  # a power of two
      launch_scalars = jnp.concatenate([scalars, jnp.pad(
          bases, (0, slots - bases.shape[0]))])
    outs = iter(_launch_update(
        config, segments, [[group[i] for i in chunk] for group in groups],
        launch_scalars, write_extra=write_extra, interpret=interpret))
    k = len(chunk)
    for kind in range(kinds):
      like = mu if kind == 1 else (nu if kind == 2 else p)
      if segments.quant_blocks is not None and quantized.is_quantized(
          like[chunk[0]]):
        codes, scales = [next(outs) for _ in range(k)], [
            next(outs) for _ in range(k)]
        for i, c, sc in zip(chunk, codes, scales):
          results[kind][i] = quantized.QuantizedMoment(
              c.reshape(like[i].codes.shape), sc.reshape(like[i].scales.shape))
        continue
      for i in chunk:
        results[kind][i] = next(outs).reshape(p[i].shape)
  ordered = [[r[i] for i in range(len(g))] for r in results]
  return Outputs(ordered[0], ordered[1], ordered[2],
                 ordered[3] if kinds == 4 else None)


def _launches(mu, nu) -> list[list[int]]:
  """The leaves of each launch: up to ``LEAVES_PER_LAUNCH``, leaves with
  8-bit moments apart from the others (their kernel views differ)."""
  by_kind: dict[tuple, list[int]] = {}
  for i, (m, v) in enumerate(zip(mu, nu)):
    key = (quantized.is_quantized(m), quantized.is_quantized(v))
    by_kind.setdefault(key, []).append(i)
  return [leaves[lo:lo + LEAVES_PER_LAUNCH] for leaves in by_kind.values()
          for lo in range(0, len(leaves), LEAVES_PER_LAUNCH)]


def _quant_blocks(first_mu, first_nu, chunk, mu, nu):
  """Each leaf's block, when this launch's moments are 8-bit; else None."""
  if not (quantized.is_quantized(first_mu)
          or quantized.is_quantized(first_nu)):
    return None
  return tuple((mu[i] if quantized.is_quantized(mu[i]) else nu[i]).block
               for i in chunk)


def stats_fn(interpret: bool):
  """This module's statistics pass, for the backend registry."""
  return functools.partial(grad_stats, interpret=interpret)


def update_fn(interpret: bool):
  """This module's update pass, for the backend registry."""
  return functools.partial(update, interpret=interpret)


__all__ = [
    "BLOCK",
    "LEAVES_PER_LAUNCH",
    "STATS_BLOCKS",
    "grad_stats",
    "Segments",
    "stats_fn",
    "update",
    "update_fn",
]
