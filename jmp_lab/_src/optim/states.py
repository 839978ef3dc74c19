"""The optimizer states of jmp_lab, and the accessors that read them.

Both optimizers keep the same public fields, so code that trains with one can
switch to the other:

* ``master_params`` -- the fp32 master (a tree, or a flat buffer for
  :func:`~jmp_lab.fused_adamw` with ``layout="flat"``), or None
  when the params are fp32 and are the master themselves;
* ``loss_scale`` -- the :class:`~jmp_lab.LossScale` for the next step;
* ``skipped_steps`` -- how many steps were skipped for non-finite gradients;
* ``last_step_applied`` -- whether the last ``update`` was applied (False when
  it was skipped), like optax's ``ApplyIfFiniteState.last_finite``;
* ``policy`` -- the policy the optimizer was built with (static data).

The accessors find the one jmp_lab state by its type, however deeply it is
nested (inside ``optax.chain``, ``MultiSteps``, a ``TrainState``...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Union

import jax
import numpy as np
import optax

from jmp_lab.kernels import remainder
from jmp_lab.kernels.quantized import QuantizedMoment  # noqa: F401  (re-exported)
from jmp_lab.kernels import pytrees
from jmp_lab._src.optim import boxes
from jmp_lab._src.policy import Policy


@dataclasses.dataclass(frozen=True)
class ParamsSpec:
  """The structure, shapes and dtypes an optimizer state was built for.

  Static (no leaves): it travels in the state's tree structure, so a state
  used with other params is refused by name instead of failing inside XLA.
  """

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]

  @classmethod
  def of(cls, params: Any) -> "ParamsSpec":
    """The spec of ``params``' values: partition boxes do not count, so a
    state built boxed accepts the unboxed params (MaxText's flow)."""
    params = boxes.unboxed(params)
    leaves = pytrees.leaves_with_paths(params)
    return cls(jax.tree_util.tree_structure(params),
               tuple(path for path, _ in leaves),
               tuple(tuple(np.shape(x)) for _, x in leaves),
               tuple(_dtype_name(x) for _, x in leaves))

  def describe_mismatch(self, params: Any) -> Optional[str]:
    """How ``params`` differs from this spec, naming the first leaf; or None."""
    other = ParamsSpec.of(params)
    if other.treedef != self.treedef:
      only_params = [p for p in other.paths if p not in set(self.paths)]
      only_state = [p for p in self.paths if p not in set(other.paths)]
      if only_params or only_state:
        return (f"leaf paths differ: only in params: "
                f"{only_params[:5] or 'none'}; only in the optimizer state: "
                f"{only_state[:5] or 'none'}")
      return f"tree structures differ: {other.treedef} vs {self.treedef}"
    for path, shape, dtype, want_shape, want_dtype in zip(
        other.paths, other.shapes, other.dtypes, self.shapes, self.dtypes):
      if (shape, dtype) != (want_shape, want_dtype):
        return (f"param {path} is {dtype}{list(shape)} but the optimizer "
                f"state was built for {want_dtype}{list(want_shape)}")
    return None

  def check(self, params: Any) -> None:
    """Raises ValueError if ``params`` is not what the state was built for."""
    mismatch = self.describe_mismatch(params)
    if mismatch is not None:
      raise ValueError(
          f"the optimizer state does not match the params (was it built for "
          f"another model?): {mismatch}")


jax.tree_util.register_static(ParamsSpec)


def _dtype_name(x: Any) -> str:
  return np.dtype(x.dtype).name if hasattr(x, "dtype") else type(x).__name__


class MixedPrecisionState(NamedTuple):
  """State of :func:`jmp_lab.mixed_precision`."""

  master_params: Optional[optax.Params]  # fp32 tree, or None for fp32 params
  inner_state: optax.OptState            # the wrapped transformation's state
  loss_scale: Any                        # a jmp_lab.LossScale
  skipped_steps: jax.Array               # int32 scalar
  last_step_applied: jax.Array           # bool scalar
  params_spec: ParamsSpec                # static: the params it was built for
  master_remainder: Optional[Any] = None  # uint16 tree (master="remainder")
  rounding_key: Optional[jax.Array] = None  # key data (stochastic rounding)
  policy: Optional[Policy] = None         # static: the policy it was built for

  def master_tree(self, params: Any = None) -> Optional[optax.Params]:
    """The master params as a tree (None when no master is kept).

    With ``master="remainder"`` the master is rebuilt from ``params``.
    """
    if self.master_remainder is None:
      return self.master_params
    return _joined_master(params, self.master_remainder)


def _joined_master(params: Any, remainders: Any, other: str = "keep") -> Any:
  """The fp32 master of ``master="remainder"``: params + remainders.

  Non-trainable leaves (no remainder) are the params' (``other="keep"``, as
  ``mixed_precision``'s master) or None (``"none"``, as ``fused_adamw``'s).
  """
  if params is None:
    raise ValueError(
        "this state keeps the master as the params plus a remainder "
        "(master='remainder'): pass the params, "
        "jmp_lab.master_params(opt_state, params)")
  return jax.tree_util.tree_map(
      lambda p, r: (p if other == "keep" else None) if r is None
      else remainder.join(p, r), params, remainders,
      is_leaf=lambda x: x is None)


class FusedAdamWState(NamedTuple):
  """State of :func:`jmp_lab.fused_adamw`."""

  count: jax.Array                       # applied (not skipped) steps, int32
  master_params: Optional[Any]           # fp32 (tree or flat), None for fp32 params
  mu: Any                                # first moment (tree or flat)
  nu: Any                                # second moment (tree or flat)
  loss_scale: Any                        # a jmp_lab.LossScale
  skipped_steps: jax.Array               # int32 scalar
  last_step_applied: jax.Array           # bool scalar
  layout: Any                            # static: TreeLayout or FlatLayout
  params_spec: ParamsSpec                # static: the params it was built for
  master_remainder: Optional[Any] = None  # uint16 tree (master="remainder")
  # Key data of stochastic rounding (master="none"); each step's bits come
  # from it and ``count``, so a skipped step draws nothing.
  rounding_key: Optional[jax.Array] = None
  policy: Optional[Policy] = None         # static: the policy it was built for

  def master_tree(self, params: Any = None) -> Optional[Any]:
    """The fp32 master as a tree (non-trainable leaves are None; rebuilt
    from ``params`` with ``master="remainder"``)."""
    if self.master_remainder is not None:
      return _joined_master(params, self.master_remainder, other="none")
    if self.master_params is None:
      return None
    tree = self.layout.master_tree(self.master_params)
    if params is None:
      return tree
    # Wrapped as the params are (Flax's boxes, NNX Variables): the flat
    # buffer's tree view holds values only, while the tree layout's stored
    # master is wrapped already (read through, so it is wrapped once).
    return boxes.boxed_like(params, boxes.values_of(tree))


State = Union[MixedPrecisionState, FusedAdamWState]
_STATE_TYPES = (MixedPrecisionState, FusedAdamWState)


def _is_state(x: Any) -> bool:
  return isinstance(x, _STATE_TYPES)


def find_state(opt_state: Any) -> State:
  """The one jmp_lab optimizer state inside ``opt_state``.

  Raises:
    ValueError: if there is none, or more than one.
  """
  found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_state)
           if _is_state(x)]
  if not found:
    raise ValueError(
        f"expected exactly one jmp_lab optimizer state in opt_state, found "
        f"none in a {type(opt_state).__name__}; build the optimizer "
        f"with jmp_lab.mixed_precision(...) or jmp_lab.fused_adamw(...)")
  if len(found) > 1:
    # optax.multi_transform around jmp_lab optimizers: a loss scale and a
    # skip decision per group, where one step needs one of each.
    raise ValueError(
        f"expected exactly one jmp_lab optimizer state in opt_state, found "
        f"{len(found)} in a {type(opt_state).__name__}: one jmp_lab "
        f"optimizer wraps the whole update, with one loss scale and one "
        f"skip decision. Put a combinator of several optimizers inside it: "
        f"jmp_lab.mixed_precision(optax.multi_transform({{...}}, labels), "
        f"policy=...)")
  return found[0]


def master_params(opt_state: Any, params: Any = None
                  ) -> Optional[optax.Params]:
  """The fp32 master params held in ``opt_state``, as a tree.

  Returns None when the policy's ``param_dtype`` is float32 (or float64): the
  params are then the master and no copy is kept (``"mixed_bfloat16"``,
  ``"mixed_float16"``); and with ``master="none"``. For bf16 params with an
  fp32 master, use the policy ``"p=bf16,c=bf16,o=f32"``. With
  ``master="remainder"`` the master is the params plus the remainder in the
  state: pass ``params``.

  Example::

    >>> import jax.numpy as jnp, optax, jmp_lab
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> tx = jmp_lab.mixed_precision(optax.sgd(0.1), policy="p=bf16,c=bf16,o=f32")
    >>> master_params(tx.init(params))["w"].dtype
    dtype('float32')
    >>> tx = jmp_lab.mixed_precision(optax.sgd(0.1), policy="mixed_bfloat16")
    >>> master_params(tx.init({"w": jnp.ones(3)})) is None   # fp32 params
    True
  """
  return find_state(opt_state).master_tree(params)


def current_loss_scale(opt_state: Any) -> Any:
  """The loss scale to use for the next forward pass."""
  return find_state(opt_state).loss_scale


def skipped_steps(opt_state: Any) -> jax.Array:
  """How many steps were skipped for non-finite gradients so far."""
  return find_state(opt_state).skipped_steps


def last_step_applied(opt_state: Any) -> jax.Array:
  """Whether the last update was applied (a scalar bool; True after init)."""
  return find_state(opt_state).last_step_applied


def optimizer_policy(opt_state: Any) -> Optional[Policy]:
  """The policy the jmp_lab optimizer of ``opt_state`` was built with, or
  None when ``opt_state`` holds no jmp_lab state."""
  try:
    return find_state(opt_state).policy
  except ValueError:
    return None
