"""The multi-tensor AdamW step as one op that XLA's partitioner can split.

A Pallas kernel is a custom call that XLA's SPMD partitioner cannot see
into. With the optimizer state sharded over devices (ZeRO-1,
:func:`jmp_lab.sharding.state_shardings`), XLA would gather every operand
and run the whole kernel on every device: an fp32 all-gather of the master
and both moments each step. :func:`tree_step` wraps the statistics kernel,
the scalar arithmetic after it and the update kernel in one
``custom_partitioning`` op whose rule is "leaf by leaf, element-wise": each
device runs both kernels on its own shards of the leaves, with each leaf's
gradient, master and moments sharded alike (the moments' sharding decides,
so the gradients are reduce-scattered into it), and hands back its shards
of the new params (which XLA then all-gathers where they are replicated).

The finite flag and the clip norm are global: the statistics of leaves
sharded over mesh axes ``A`` are summed over ``A`` (``psum``), those of
replicated leaves counted once, and the flag is the minimum over all axes,
before the update runs. Runs on one device, or with every operand
replicated, are the same program as without this wrapper.

Stochastic rounding draws its bits from each element's index in its whole
leaf: a device hands the update its shard's first index in the leaf (from
its position on the mesh), and the kernel maps the shard's elements to
their indices in the leaf (:func:`jmp_lab.kernels.rounding.global_index`),
so every device rounds its shard with the bits one device rounding the
whole leaf would draw, and no leaf is gathered.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec as P

from jmp_lab.kernels import quantized, registry, rounding, stats
from jmp_lab.kernels.reference import Outputs


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
  """What :func:`tree_step` runs (static: hashed by identity).

  Attributes:
    run_stats: ``(g leaves, scale) -> (sum of squares, all finite)``.
    scalars_fn: ``(sumsq, finite, scalar_args) -> (hyper, flags, finite)``.
    run_update: ``(g, p, mu, nu, hyper, flags, remainders, index_maps)
      -> Outputs`` (``index_maps``: None, or for shards a ``(global shape,
      base index)`` per leaf).
    leaves: how many leaves.
    remainders: whether the remainders are an operand.
    result_groups: 3 or 4 lists of leaves in the ``Outputs``.
    stochastic: stochastic rounding (the update needs the shards' places).
    mu_quantized, nu_quantized: per leaf, whether its moment is 8-bit (a
      ``QuantizedMoment``: codes like the leaf, and scales whose last axis
      counts blocks).
  """

  run_stats: Callable[[Sequence[jax.Array], jax.Array], tuple]
  scalars_fn: Callable[[jax.Array, jax.Array, Any], tuple]
  run_update: Callable[..., Outputs]
  leaves: int
  remainders: bool
  result_groups: int
  stochastic: bool
  mu_quantized: tuple[bool, ...] = ()
  nu_quantized: tuple[bool, ...] = ()


def _step(plan: StepPlan, groups, shards, g, p, mu, nu, remainders, scale,
          scalar_args):
  """Statistics, scalars, update; ``groups`` is ``((mesh axes, leaf
  indices), ...)``: each group's statistics are summed over its axes.
  ``shards``: None for whole leaves, else each leaf's ``(global shape,
  spec)``, for stochastic rounding's indices."""
  sumsq, finite = jnp.float32(0), jnp.bool_(True)
  every_axis = tuple(sorted({a for axes, _ in groups for a in axes}))
  for axes, leaves in groups:
    part_sumsq, part_finite = plan.run_stats([g[i] for i in leaves], scale)
    if axes:
      part_sumsq = jax.lax.psum(part_sumsq, axes)
    sumsq, finite = sumsq + part_sumsq, finite & part_finite
  finite = stats.agree(finite, every_axis)  # one non-finite shard: all skip
  hyper, flags, finite = plan.scalars_fn(sumsq, finite, scalar_args)
  index_maps = None
  if plan.stochastic and shards is not None and any(
      tuple(local.shape) != shape for (shape, _), local in zip(shards, p)):
    index_maps = [(shape, _base(shape, tuple(local.shape), spec))
                  for (shape, spec), local in zip(shards, p)]
  return plan.run_update(g, p, mu, nu, hyper, flags, remainders,
                         index_maps), finite


def _base(global_shape, local_shape, spec: P) -> jax.Array:
  """This device's shard's first index in the whole leaf (inside the
  partitioned op, where the mesh axes are bound)."""
  offsets = []
  for dim, size in enumerate(local_shape):
    entry = spec[dim] if dim < len(spec) else None
    axes = () if entry is None else (
        tuple(entry) if isinstance(entry, tuple) else (entry,))
    offsets.append(jax.lax.axis_index(axes) * size if axes else 0)
  return rounding.shard_base(tuple(offsets), tuple(global_shape))


def _spec_axes(spec: P) -> tuple[str, ...]:
  axes = []
  for entry in spec:
    if entry is not None:
      axes.extend(entry if isinstance(entry, tuple) else (entry,))
  return tuple(axes)


def _like_moments(moments, named):
  """``named`` (one sharding a leaf) shaped as the moment list: an 8-bit
  moment's codes and scales both take its leaf's (their ranks agree; a
  shard of the last axis holds whole blocks)."""
  return [quantized.QuantizedMoment(n, n) if quantized.is_quantized(m) else n
          for m, n in zip(moments, named)]


def _in_whole_blocks(i: int, spec: P, moments, mesh) -> P:
  """``spec``, or ``spec`` with the last axis whole where its shards would
  cut an 8-bit moment's blocks in two (the partitioner then gathers that
  axis for the update, and reshards the results as asked): slower, never
  wrong. ``state_shardings`` refuses such a layout outright."""
  for m in filter(quantized.is_quantized, moments):
    cut = quantized.blocks_cut(f"leaf {i} of the update",
                               tuple(m.codes.shape), m.block, spec, mesh)
    if cut:
      warnings.warn(cut + " The update gathers that axis instead.",
                    stacklevel=2)
      return P(*spec[:len(m.codes.shape) - 1], None)
  return spec


def _partition(plan: StepPlan, mesh, arg_shapes, result_shape):
  _, _, mu, nu, remainders, scale, scalar_args = arg_shapes
  # Each leaf as its first moment (its codes, when 8-bit) is sharded.
  specs = [s.sharding.spec if isinstance(s.sharding, NamedSharding) else P()
           for s in (m.codes if quantized.is_quantized(m) else m
                     for m in mu)]
  specs = [_in_whole_blocks(i, spec, moments, mesh)
           for i, (spec, *moments) in enumerate(zip(specs, mu, nu))]
  named = [NamedSharding(mesh, spec) for spec in specs]
  whole = lambda tree: jax.tree_util.tree_map(  # noqa: E731
      lambda _: NamedSharding(mesh, P()), tree)
  by_axes: dict[tuple, list[int]] = {}
  for i, spec in enumerate(specs):
    by_axes.setdefault(_spec_axes(spec), []).append(i)
  groups = tuple((axes, tuple(leaves)) for axes, leaves in by_axes.items())
  arg_shardings = (named, named, _like_moments(mu, named),
                   _like_moments(nu, named),
                   None if remainders is None else named,
                   whole(scale), whole(scalar_args))
  out, _ = result_shape
  result_shardings = (Outputs(*[None if kind is None else
                                _like_moments(kind, named)
                                for kind in out]),
                      NamedSharding(mesh, P()))
  shards = tuple((tuple(s.shape), spec) for s, spec in zip(mu, specs))
  return (mesh, functools.partial(_step, plan, groups, shards),
          result_shardings, arg_shardings)


def _sharding_rule(plan: StepPlan, mesh, value_types, result_types
                   ) -> SdyShardingRule:
  """Leaf ``i``'s dimensions are the same factors in its gradient, params,
  remainder, moments and outputs; the scalars' are never sharded."""
  del mesh
  n = plan.leaves
  ranks = [len(t.shape) for t in value_types]
  leaf = lambda i: tuple(f"l{i}d{d}" for d in range(ranks[i]))  # noqa: E731

  def moment(i, is_quantized):
    # codes as the leaf; scales as the leaf but their own last axis (blocks)
    if not is_quantized:
      return [leaf(i)]
    return [leaf(i), leaf(i)[:-1] + (f"l{i}blocks",)]

  def moments(flags):
    flags = flags or (False,) * n
    return [m for i in range(n) for m in moment(i, flags[i])]

  every_leaf = [leaf(i) for i in range(n)]
  # Operands: g, p, mu, nu, [remainders], then the scalars.
  operands = every_leaf * 2 + moments(plan.mu_quantized) + moments(
      plan.nu_quantized) + (every_leaf if plan.remainders else [])
  leaf_operands = len(operands)
  scalars = [tuple(f"s{k}d{d}" for d in range(rank))
             for k, rank in enumerate(ranks[leaf_operands:])]
  # Results: master (or remainders), mu, nu, [extra], the finite flag.
  results = every_leaf + moments(plan.mu_quantized) + moments(
      plan.nu_quantized) + (every_leaf if plan.result_groups == 4 else [])
  results += [()]
  assert len(results) == len(result_types), (len(results), len(result_types))
  replicate = {f for mapping in scalars for f in mapping}
  # Shardy wants the special factors in the order the factors first appear.
  order = [f for mapping in operands + scalars for f in mapping]
  return SdyShardingRule(
      tuple(operands + scalars), tuple(results),
      need_replication_factors=tuple(f for f in dict.fromkeys(order)
                                     if f in replicate))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitionable_step(plan: StepPlan, g, p, mu, nu, remainders, scale,
                        scalar_args):
  every_leaf = (((), tuple(range(plan.leaves))),)
  return _step(plan, every_leaf, None, g, p, mu, nu, remainders, scale,
               scalar_args)


_partitionable_step.def_partition(partition=_partition,
                                  sharding_rule=_sharding_rule)


def tree_step(plan: StepPlan, g, p, mu, nu, remainders: Optional[list],
              scale, scalar_args, *, partitionable: bool = True):
  """``(Outputs, finite)`` of one multi-tensor step over lists of leaves.

  With ``partitionable`` the step is one ``custom_partitioning`` op (see the
  module doc); without (inside ``shard_map``, where ``scalars_fn`` combines
  the flag over the mapped axis itself) it is the plain program.
  """
  if not partitionable:
    every_leaf = (((), tuple(range(plan.leaves))),)
    return _step(plan, every_leaf, None, g, p, mu, nu, remainders, scale,
                 scalar_args)
  return _partitionable_step(plan, list(g), list(p), list(mu), list(nu),
                             None if remainders is None else list(remainders),
                             scale, scalar_args)


def backend_tree_step(name: str, config, decays, g, p, mu, nu, remainders,
                      scale, scalars_fn, scalar_args, *, write_extra: bool,
                      partitionable: bool = True):
  """``(Outputs, finite)`` with backend ``name``: the statistics over the
  gradient leaves, ``scalars_fn(sumsq, finite, scalar_args) -> (hyper,
  flags, finite)``, and the update, as one op XLA's partitioner splits leaf
  by leaf. The reference backend is XLA's own ops, which it partitions
  anyway."""
  plan = StepPlan(
      run_stats=lambda grads, s: registry.tree_grad_stats(name, grads, s),
      scalars_fn=scalars_fn,
      run_update=lambda g, p, mu, nu, hyper, flags, rem, maps: (
          registry.tree_update(name, config, decays, g, p, mu, nu, hyper,
                               flags, write_extra=write_extra,
                               remainders=rem, index_maps=maps)),
      leaves=len(g), remainders=remainders is not None,
      mu_quantized=tuple(map(quantized.is_quantized, mu)),
      nu_quantized=tuple(map(quantized.is_quantized, nu)),
      result_groups=4 if (not config.direct and (write_extra
                                                 or config.remainder)) else 3,
      stochastic=config.stochastic)
  return tree_step(plan, g, p, mu, nu, remainders, scale, scalar_args,
                   partitionable=partitionable and name != "reference")


__all__ = [
    "backend_tree_step",
    "StepPlan",
    "tree_step",
]
