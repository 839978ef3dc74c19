"""The fused AdamW update over the leaves as they are: multi-tensor kernels.

apex's ``multi_tensor_apply`` design in Pallas: one kernel launch covers many
leaves of the params (``LEAVES_PER_LAUNCH``), with no packing into a flat
buffer. Each kernel program handles one ``BLOCK`` of one leaf; the static
table of where each leaf's blocks start tells a program which leaf it is on,
and each leaf's code is a conditional block of its own.

Two kernels make one step:

1. :func:`grad_stats` reads every gradient once and writes, per block, the
   sum of squares of the unscaled gradient and whether the block is finite
   (partial results, summed by XLA in a fixed order, so runs repeat);
2. :func:`update` reads g, p, m, v and writes p, m, v (in place, aliased to
   the inputs) and the half copy; on a non-finite step it writes only the
   half copy.

Per parameter, with an fp32 master and half params (bf16-o2), that is 2 B for
the statistics, 14 B read and 14 B written by the update: 30 B, against 32
for XLA's own fusion of ``mixed_precision(optax.adamw)`` compiled for an H100
(benchmarks/RESULTS.md).

Backends: ``"triton"`` (Pallas' Triton lowering) and ``"interpret"`` (the
same kernels in Pallas interpret mode, on any device; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jmp_lab.kernels.reference import (CLIP, FINITE, INV_BIAS1, INV_BIAS2, LR,
                                       NUM_HYPER, SCALE, AdamWConfig, Outputs,
                                       adamw_elementwise)

# Leaves per kernel launch. Each leaf is a conditional block of its own in
# the kernel, and Triton's compile time grows faster than linearly with
# their number (compiled for an H100: about 4 s for 16 leaves, 24 s for 48,
# 200 s for 150); GPT-2-small's 197 leaves take 13 launches of each kernel.
LEAVES_PER_LAUNCH = 16

# Elements per kernel program: large enough that the per-program overhead
# (finding the leaf) is noise, small enough that the last, partial block of
# each leaf wastes little.
BLOCK = 2048


@dataclasses.dataclass(frozen=True)
class Segments:
  """The static plan of a multi-tensor launch.

  Attributes:
    sizes: elements of each leaf (the kernels see them flattened).
    decays: whether each leaf is weight-decayed.
  """

  sizes: tuple[int, ...]
  decays: tuple[bool, ...]

  @property
  def block_starts(self) -> tuple[int, ...]:
    """The first program of each leaf."""
    return tuple(int(x) for x in np.cumsum((0,) + self.blocks)[:-1])

  @property
  def blocks(self) -> tuple[int, ...]:
    return tuple(-(-size // BLOCK) for size in self.sizes)

  @property
  def total_blocks(self) -> int:
    return sum(self.blocks)


def _compiler_params(interpret: bool):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton  # GPU builds only
  return pltriton.CompilerParams(num_warps=4, num_stages=1)


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
  """Leaf ``i``'s slice and mask for this program."""
  offset = (program - segments.block_starts[i]) * BLOCK
  index = offset + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
  return pl.ds(offset, BLOCK), index < segments.sizes[i]


def _stats_kernel(segments: Segments, scale_ref, *refs):
  grads, (sumsq_out, finite_out) = refs[:-2], refs[-2:]
  load, _ = _masked_io()
  # Read outside pl.when: interpret mode only substitutes the program id at
  # the kernel's top level.
  program = pl.program_id(0)
  scale = scale_ref[0]

  def leaf_stats(i):
    where, mask = _block(program, segments, i)
    # Unscaled as the optimizers unscale: the flag and the norm are theirs.
    g = load(grads[i].at[where], mask=mask, other=0).astype(jnp.float32) / scale
    sumsq_out[...] = jnp.full((1,), jnp.sum(g * g), jnp.float32)
    # A min, not jnp.all: Triton has no boolean reduction.
    finite_out[...] = jnp.full(
        (1,), jnp.min(jnp.isfinite(g).astype(jnp.int32)), jnp.int32)

  _for_each_leaf(program, segments, leaf_stats)


def _launch_stats(grads: Sequence[jax.Array], scale: jax.Array, *,
                  interpret: bool) -> tuple[jax.Array, jax.Array]:
  segments = Segments(tuple(g.size for g in grads), (False,) * len(grads))
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
  per block; XLA sums them in a fixed order, so runs are reproducible.
  """
  scale = jnp.reshape(scale, (1,)).astype(jnp.float32)
  partials = [_launch_stats([grads[i] for i in chunk], scale,
                            interpret=interpret)
              for chunk in _chunks(len(grads))]
  sumsq = jnp.concatenate([s for s, _ in partials])
  finite = jnp.concatenate([f for _, f in partials])
  return jnp.sum(sumsq), jnp.all(finite == 1)


def _update_kernel(config: AdamWConfig, segments: Segments, write_extra: bool,
                   hyper_ref, flags_ref, *refs):
  n = len(segments.sizes)
  g, p, mu, nu = (refs[k * n:(k + 1) * n] for k in range(4))
  p_out, mu_out, nu_out = (refs[(4 + k) * n:(5 + k) * n] for k in range(3))
  extra_out = refs[7 * n:] if write_extra else None
  load, store = _masked_io()
  # Read outside pl.when: interpret mode only substitutes the program id at
  # the kernel's top level.
  program = pl.program_id(0)
  finite = flags_ref[FINITE] == 1
  hyper = tuple(hyper_ref[k] for k in (LR, INV_BIAS1, INV_BIAS2, SCALE, CLIP))

  def leaf_update(i):
    where, mask = _block(program, segments, i)
    p_ = load(p[i].at[where], mask=mask, other=0)

    @pl.when(finite)
    def _update():
      g_, mu_, nu_ = (load(r[i].at[where], mask=mask, other=0)
                      for r in (g, mu, nu))
      out = adamw_elementwise(config, g_, p_, mu_, nu_,
                              jnp.bool_(segments.decays[i]), *hyper)
      targets = (p_out, mu_out, nu_out) + ((extra_out,) if write_extra else ())
      for target, value in zip(targets, out):
        store(target[i].at[where], value.astype(target[i].dtype), mask=mask)

    if write_extra:
      @pl.when(jnp.logical_not(finite))
      def _skip():
        # p, m and v are aliased to their inputs: not writing them keeps
        # them. The extra output is a fresh buffer and must hold the old
        # values.
        old = (jnp.zeros_like(p_) if config.half_dtype is None
               else p_.astype(config.half_dtype))
        store(extra_out[i].at[where], old, mask=mask)

  _for_each_leaf(program, segments, leaf_update)


def _launch_update(config: AdamWConfig, segments: Segments, g, p, mu, nu,
                   hyper, flags, *, write_extra: bool, interpret: bool):
  n = len(g)
  extra_dtype = jnp.float32 if config.half_dtype is None else config.half_dtype
  out_shape = [jax.ShapeDtypeStruct((size,), jnp.float32)
               for size in segments.sizes] * 3
  if write_extra:
    out_shape += [jax.ShapeDtypeStruct((size,), extra_dtype)
                  for size in segments.sizes]
  flat = lambda xs: [x.reshape(-1) for x in xs]  # noqa: E731
  return pl.pallas_call(
      functools.partial(_update_kernel, config, segments, write_extra),
      out_shape=out_shape,
      grid=(segments.total_blocks,),
      in_specs=[pl.BlockSpec((8,), lambda i: (0,)),
                pl.BlockSpec((2,), lambda i: (0,))]
      + [pl.no_block_spec] * (4 * n),
      out_specs=[pl.no_block_spec] * len(out_shape),
      # Operands: hyper, flags, g..., p..., mu..., nu... -> p..., mu..., nu...
      input_output_aliases={2 + n + k: k for k in range(3 * n)},
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="jmp_lab_multi_tensor_adamw",
  )(hyper, flags, *flat(g), *flat(p), *flat(mu), *flat(nu))


def update(config: AdamWConfig, decays: Sequence[bool],
           g: Sequence[jax.Array], p: Sequence[jax.Array],
           mu: Sequence[jax.Array], nu: Sequence[jax.Array], hyper: jax.Array,
           flags: jax.Array, *, write_extra: bool, interpret: bool
           ) -> Outputs:
  """One fused AdamW step over lists of leaves (see ``reference``).

  ``p``, ``mu`` and ``nu`` are updated in place (donate them to make it
  real). Without ``write_extra`` the fourth output is None: the caller needs
  neither the half copy nor the fp32 update (fp32 params, new-params path).
  """
  # Triton blocks must be powers of two: pad the scalars to eight.
  hyper = jnp.pad(hyper, (0, 8 - NUM_HYPER))
  results: list[list[jax.Array]] = [[], [], [], []]
  for chunk in _chunks(len(g)):
    segments = Segments(tuple(p[i].size for i in chunk),
                        tuple(bool(decays[i]) for i in chunk))
    outs = _launch_update(config, segments, *([x[i] for i in chunk]
                                              for x in (g, p, mu, nu)),
                          hyper, flags, write_extra=write_extra,
                          interpret=interpret)
    k = len(chunk)
    for kind in range(4 if write_extra else 3):
      results[kind] += [x.reshape(p[i].shape) for x, i in
                        zip(outs[kind * k:(kind + 1) * k], chunk)]
  return Outputs(results[0], results[1], results[2],
                 results[3] if write_extra else None)
