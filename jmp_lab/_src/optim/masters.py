"""How the fp32 master is kept: one strategy per mode, for both optimizers.

* ``"float32"``: an fp32 copy of half params (4 B/param); fp32 params are
  their own master and no copy is kept.
* ``"remainder"``: bf16 params and the lower 16 bits of the fp32 master
  (2 B/param), rebuilt exactly every step (:mod:`jmp_lab.remainder`).
* ``"none"``: no master; the half params are updated directly, rounded to
  nearest or stochastically (bf16 only; :mod:`jmp_lab.rounding`).

A :class:`Master` says what the state holds at ``init`` (the master copy,
the remainders, the rounding key), how ``mixed_precision`` reads the fp32
master and writes the new one back, and which of these the fused kernel
does itself (:meth:`Master.kernel_flags`). A new mode is a change here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels import remainder
from jmp_lab.kernels import pytrees
from jmp_lab.kernels import rounding as rounding_lib
from jmp_lab._src.optim.gate import merge_floating
from jmp_lab._src.policy import Policy

MODES = ("float32", "remainder", "none")
ROUNDINGS = ("nearest", "stochastic")


def check_mode(master: str, rounding: str, policy: Policy) -> None:
  """Refuses a master/rounding combination the policy cannot have."""
  if master not in MODES:
    raise ValueError(f"unknown master {master!r}; accepted: "
                     f"{', '.join(map(repr, MODES))}")
  if rounding not in ROUNDINGS:
    raise ValueError(f"unknown rounding {rounding!r}; accepted: "
                     f"{', '.join(map(repr, ROUNDINGS))}")
  if master != "none" and rounding != "nearest":
    raise ValueError(
        f"rounding={rounding!r} needs master='none': with master={master!r} "
        f"the params are cast(master), rounded to nearest")
  if master == "float32":
    return
  dtype = np.dtype(policy.param_dtype)
  if dtype.itemsize >= 4:
    raise ValueError(
        f"master={master!r} needs half params, but the policy's param dtype "
        f"is {dtype.name}: fp32 params are their own master")
  if master == "remainder" and dtype != np.dtype(jnp.bfloat16):
    raise ValueError(
        f"master='remainder' needs bfloat16 params (bf16 is the upper half of "
        f"an fp32 number; {dtype.name} is not): use master='float32'")
  if rounding == "stochastic" and dtype != np.dtype(jnp.bfloat16):
    raise ValueError(
        f"rounding='stochastic' needs bfloat16 params, got {dtype.name}")


def as_f32(tree: Any) -> Any:
  """The floating leaves of ``tree`` in fp32."""
  return jax.tree_util.tree_map(
      lambda x: x.astype(jnp.float32) if pytrees.is_floating_array(x) else x,
      tree)


@dataclasses.dataclass(frozen=True)
class Master:
  """One master mode (see the module doc), for one policy.

  Attributes:
    mode: ``"float32"``, ``"remainder"`` or ``"none"``.
    rounding: ``"nearest"`` or ``"stochastic"`` (``"none"`` only).
    seed: the stochastic-rounding key's seed.
    half_params: the params are half: an fp32 copy is kept in mode
      ``"float32"``; with fp32 params the params are the master.
  """

  mode: str
  rounding: str
  seed: int
  half_params: bool

  @classmethod
  def of(cls, mode: str, rounding: str, seed: int, policy: Policy
         ) -> "Master":
    check_mode(mode, rounding, policy)
    return cls(mode, rounding, seed,
               np.dtype(policy.param_dtype).itemsize < 4)

  @property
  def fp32_copy(self) -> bool:
    """Whether the state holds an fp32 copy of the params."""
    return self.half_params and self.mode == "float32"

  @property
  def stochastic(self) -> bool:
    return self.rounding == "stochastic"

  def kernel_flags(self) -> dict:
    """The fused kernel's flags for this mode (:class:`AdamWConfig`)."""
    return dict(remainder=self.mode == "remainder",
                direct=self.half_params and self.mode == "none",
                stochastic=self.stochastic)

  # ---- init --------------------------------------------------------------

  def copy_of(self, x: jax.Array) -> Optional[jax.Array]:
    """A leaf's fp32 master copy at init (None where none is kept)."""
    return x.astype(jnp.float32) if self.fp32_copy else None

  def remainder_of(self, x: jax.Array) -> Optional[jax.Array]:
    """A leaf's remainder at init: zero, since the params are the master
    exactly (None outside mode ``"remainder"``)."""
    if self.mode != "remainder":
      return None
    return jnp.zeros_like(x, jnp.uint16)  # sharded as the param is

  def rounding_key(self) -> Optional[jax.Array]:
    """The stochastic-rounding key's raw data (uint32, which every
    checkpointer can save), or None."""
    if not self.stochastic:
      return None
    return jax.random.key_data(jax.random.key(self.seed))

  def init_tree(self, params: Any) -> dict:
    """The state fields of a tree optimizer: ``master_params``,
    ``master_remainder`` and ``rounding_key``."""
    floating = lambda fn: jax.tree_util.tree_map(  # noqa: E731
        lambda x: fn(x) if pytrees.is_floating_array(x) else None, params)
    return dict(
        master_params=as_f32(params) if self.fp32_copy else None,
        master_remainder=(floating(self.remainder_of)
                          if self.mode == "remainder" else None),
        rounding_key=self.rounding_key())

  # ---- mixed_precision's step ----------------------------------------------

  def read(self, state: Any, params: Any) -> Any:
    """The fp32 master ``mixed_precision`` updates: rebuilt from the
    remainder, the params in fp32 when none is kept, or the copy."""
    if self.mode == "remainder":
      return state.master_tree(params)
    if self.mode == "none":
      return as_f32(params)
    return params if state.master_params is None else state.master_params

  def write(self, params: Any, new_trainable: Any, inner_updates: Any,
            finite: jax.Array, state: Any, new_state: Any
            ) -> tuple[Any, Any]:
    """``(updates, new state)``: updates that land the params exactly on
    ``cast(new master)`` (or on its rounding with no master), and the new
    master kept as the mode keeps it."""
    if self.mode == "none" and self.half_params:
      return _direct_updates(params, new_trainable, finite, state, new_state,
                             self.stochastic)
    if not self.half_params:
      # The params are the master, and apply_updates(p, u) is by definition
      # how the new master was computed: hand back u itself (zero if skipped).
      updates = merge_floating(
          jax.tree_util.tree_map(
              lambda u: jnp.where(finite, u, jnp.zeros_like(u)),
              inner_updates),
          jax.tree_util.tree_map(jnp.zeros_like, params))
      return updates, new_state
    updates, new_master = _exact_updates(
        params, merge_floating(new_trainable, params))
    if self.mode == "remainder":
      return updates, new_state._replace(master_remainder=jax.tree_util.tree_map(
          lambda m, r: None if r is None else remainder.split(m)[1],
          new_master, state.master_remainder, is_leaf=lambda x: x is None))
    return updates, new_state._replace(master_params=new_master)


def _exact_updates(params: Any, new_master: Any) -> tuple[Any, Any]:
  """Updates with ``apply_updates(params, updates) == cast(new_master)``.

  Returns ``(updates, new_master)``, the master snapped where needed (see
  :func:`jmp_lab.remainder.reachable_half`).
  """

  def leaf(p, m):
    if not pytrees.is_floating_array(p):
      return remainder.ReachableHalf(m, p, jnp.zeros_like(p))
    return remainder.reachable_half(p, m, p.dtype)

  out = jax.tree_util.tree_map(leaf, params, new_master)
  is_out = lambda x: isinstance(x, remainder.ReachableHalf)  # noqa: E731
  updates = jax.tree_util.tree_map(lambda o: o.update, out, is_leaf=is_out)
  master = jax.tree_util.tree_map(lambda o: o.master, out, is_leaf=is_out)
  return updates, master


def _direct_updates(params, new_trainable, finite, state, new_state,
                    stochastic: bool):
  """``master="none"``: updates that move the half params to the new fp32
  values rounded to the param dtype (to nearest, or stochastically with the
  state's key; a skipped step leaves the key as it was)."""
  leaves, treedef = jax.tree_util.tree_flatten(
      new_trainable, is_leaf=lambda x: x is None)
  if stochastic:
    key, step_key = jax.random.split(
        jax.random.wrap_key_data(state.rounding_key))
    targets = [None if x is None else rounding_lib.stochastic_round_bf16(
        x, jax.random.bits(jax.random.fold_in(step_key, i), x.shape,
                           jnp.uint32)) for i, x in enumerate(leaves)]
    new_state = new_state._replace(rounding_key=jnp.where(
        finite, jax.random.key_data(key), state.rounding_key))
  else:
    targets = leaves
  rounded = merge_floating(treedef.unflatten(targets), params)

  def leaf(p, target):
    if not pytrees.is_floating_array(p):
      return jnp.zeros_like(p)
    # The update that takes p to the rounded value (see jmp_lab.remainder).
    half = target.astype(p.dtype).astype(jnp.float32)
    return remainder.reachable_half(p, half, p.dtype).update

  return jax.tree_util.tree_map(leaf, params, rounded), new_state
