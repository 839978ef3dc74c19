"""``fused_adamw``'s tree layout: master and moments as trees like the
params, updated by the multi-tensor kernels (no packing)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_lab import _checks
from jmp_lab.kernels import rounding as rounding_lib
from jmp_lab._src.optim import gate
from jmp_lab._src.optim.fused_spec import FusedSpec
from jmp_lab._src.optim.states import FusedAdamWState
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels import mesh as mesh_lib
from jmp_lab.kernels import partitioned, quantized, stats


def init(spec: FusedSpec, params: Any, common: dict) -> FusedAdamWState:
  """The state: the master as the mode keeps it, zero moments."""
  tree_layout = flat_layout.make_tree_layout(params, spec.decay_mask(params),
                                             spec.policy.param_dtype)
  leaves = tree_layout.leaves(params)
  master = spec.master

  def tree_of(make):
    return tree_layout.tree([make(x) for x in leaves])

  return FusedAdamWState(
      master_params=tree_of(master.copy_of) if master.fp32_copy else None,
      master_remainder=(tree_of(master.remainder_of)
                        if master.mode == "remainder" else None),
      mu=tree_of(lambda x: zero_moment(x, spec.mu_dtype, second=False)),
      nu=tree_of(lambda x: zero_moment(x, spec.nu_dtype, second=True)),
      layout=tree_layout, rounding_key=master.rounding_key(), **common)


def zero_moment(param: jax.Array, dtype, *, second: bool) -> Any:
  """A zero moment for ``param``: an array of ``dtype``, or for an 8-bit
  dtype a :class:`~jmp_lab.kernels.quantized.QuantizedMoment` (fp32 where
  the leaf is too small or no block divides it)."""
  kind = quantized.kind_of(dtype)
  if kind is None:
    # zeros_like: a sharded param (NNX's eager sharding) gives moments
    # sharded as it is, not replicated.
    return jnp.zeros_like(param, dtype)
  if not quantized.quantizable(param.shape):
    return jnp.zeros_like(param, jnp.float32)
  return quantized.zeros(param.shape, kind, second, like=param)


def step(spec: FusedSpec, grads: Any, state: FusedAdamWState, params: Any,
         write_extra: bool, also_finite: Any, carried_scale: Any) -> tuple:
  """The multi-tensor pass: ``(kernel outputs, new state)``.

  Two kernels over the leaves as they are: the gradient statistics (finite
  flag and clip norm), then the update, in place. The gradients are
  divided by ``carried_scale`` (the loss scale they carry: the state's for
  the scaled loss's, ``NoOpLossScale`` for plain ones).
  """
  state.params_spec.check(params)
  _checks.check_params(params, spec.policy)
  _checks.check_grads(grads, params)
  config, tree_layout = spec.config, state.layout
  g = tree_layout.leaves(grads)
  remainders = (tree_layout.leaves(state.master_remainder)
                if config.remainder else None)
  # With a remainder the kernel reads the params and the remainder; with
  # no master, the params.
  p = tree_layout.leaves(state.master_params if spec.master.fp32_copy
                         else params)
  scale = jnp.asarray(carried_scale.loss_scale, jnp.float32)
  extra_flags = tuple(gate.flags(also_finite))

  def scalars(sumsq, finite, scalar_args):
    count, scale, rounding_key, extra = scalar_args
    # The gradients are already reduced over the axis (every device holds
    # all of them), so the norm is local: summing it would count it N times.
    if extra:
      finite = stats.all_finite([], [finite, *extra])
    finite = stats.agree(finite, spec.axis_name)
    flags = [finite.astype(jnp.int32), jnp.int32(0)]
    if config.stochastic:
      seed = rounding_lib.step_seed(rounding_key, count)
      flags.append(jax.lax.bitcast_convert_type(seed, jnp.int32))
    return (spec.hyper(count, spec.clip_factor(sumsq), scale),
            jnp.stack(flags), finite)

  # One op XLA can partition leaf by leaf (ZeRO-1 under jit); inside
  # shard_map, or for arrays sharded in their type (explicit mesh axes, where
  # "auto" runs the reference, which XLA partitions itself), the plain
  # program.
  explicit = any(mesh_lib.explicitly_sharded(x) for x in p)
  out, finite = partitioned.backend_tree_step(
      spec.tree_backend, config, tree_layout.trainable_decays, g, p,
      tree_layout.leaves(state.mu), tree_layout.leaves(state.nu), remainders,
      scale, scalars, (state.count, scale, state.rounding_key, extra_flags),
      write_extra=write_extra,
      partitionable=spec.axis_name is None and not explicit)
  mu, nu = tree_layout.tree(out.mu), tree_layout.tree(out.nu)
  if config.remainder:  # outputs: remainders, mu, nu, params
    return out, spec.next_state(state, finite, None, mu, nu,
                                remainders=tree_layout.tree(out.master))
  if config.direct:  # outputs: params, mu, nu; the params go in extra
    return out._replace(extra=out.master), spec.next_state(
        state, finite, None, mu, nu)
  return out, spec.next_state(state, finite, tree_layout.tree(out.master),
                              mu, nu)
