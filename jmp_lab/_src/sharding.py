"""Layouts of a train state: data parallel, ZeRO-1, FSDP and tensor parallel.

The implementation behind :mod:`jmp_lab.sharding`, whose docstring describes it
with examples.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = Sequence[tuple[str, Any]]


def _check_mesh(mesh: Mesh) -> None:
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got "
                    f"{type(mesh).__name__}")


def _check_axis(mesh: Mesh, axis_name: str) -> int:
  _check_mesh(mesh)
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; "
                     f"its axes: {', '.join(map(repr, mesh.axis_names))}")
  return mesh.shape[axis_name]


def _split_spec(shape: tuple[int, ...], devices: int, axis_name: str) -> P:
  """The first dimension that splits evenly over ``devices`` (rows first),
  or replicated when none does (scalars, counters, odd shapes)."""
  for dim, size in enumerate(shape):
    if size >= devices and size % devices == 0:
      return P(*([None] * dim), axis_name)
  return P()


def _axes_of(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec(entries: list) -> P:
  """A ``PartitionSpec`` without trailing Nones (``P("data")``, not
  ``P("data", None)``: the two mean the same, only the first compares
  equal to what users write)."""
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return P(*entries)


def _with_zero1(spec: P, shape: tuple[int, ...], mesh: Mesh,
                axis_name: str) -> P:
  """``spec`` also split over ``axis_name`` where it is replicated along it:
  on the first dimension that is not split yet and divides evenly, else
  joined to the first split dimension that still divides evenly."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if any(axis_name in _axes_of(e) for e in entries):
    return spec
  devices = mesh.shape[axis_name]
  for dim, size in enumerate(shape):
    if entries[dim] is None and size >= devices and size % devices == 0:
      entries[dim] = axis_name
      return _spec(entries)
  for dim, size in enumerate(shape):
    axes = _axes_of(entries[dim])
    split = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if axes and size % (split * devices) == 0:
      entries[dim] = axes + (axis_name,)
      return _spec(entries)
  return spec


def optimizer_state_shardings(opt_state: Any, mesh: Mesh,
                              axis_name: str = "data") -> Any:
  """ZeRO-1: every array of ``opt_state`` split over ``axis_name`` on its
  first evenly divisible dimension (scalars and the rest replicated)."""
  devices = _check_axis(mesh, axis_name)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, _split_spec(tuple(x.shape), devices,
                                                axis_name)), opt_state)


def replicated(tree: Any, mesh: Mesh) -> Any:
  """Every leaf of ``tree`` replicated on ``mesh``."""
  return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree)


def _as_sharding(value: Any, mesh: Mesh, where: str) -> NamedSharding:
  if isinstance(value, NamedSharding):
    return value
  if isinstance(value, P):
    return NamedSharding(mesh, value)
  raise TypeError(f"params_shardings must hold NamedShardings or "
                  f"PartitionSpecs, got {type(value).__name__} at {where}")


def params_shardings_of(params: Any, mesh: Mesh,
                        rules: Optional[Rules] = None) -> Any:
  """The sharding of each param (an unboxed tree of ``NamedSharding``).

  From Flax's partition boxes where ``params`` has them
  (``nn.with_partitioning`` names mesh axes; ``nn.with_logical_partitioning``
  names logical axes, which ``rules`` map to mesh axes, as
  ``nn.logical_axis_rules`` does); else from the arrays' own
  ``NamedSharding`` on ``mesh``; else replicated.
  """
  _check_mesh(mesh)
  specs = nn.get_partition_spec(params)  # boxes -> specs, arrays -> P()
  logical = any(isinstance(x, nn.LogicallyPartitioned)
                for x in jax.tree_util.tree_leaves(
                    params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)))
  if logical:
    if rules is None:
      rules = nn.get_logical_axis_rules()
    if not rules:
      raise ValueError(
          "the params are logically partitioned (nn.with_logical_partitioning) "
          "but no rules map their logical axes to the mesh's: pass "
          "rules=[('embed', 'fsdp'), ...] or set nn.logical_axis_rules")
    specs = nn.logical_to_mesh(specs, rules)
  values = meta.unbox(params)

  def one(spec, value):
    if spec == P():
      own = getattr(value, "sharding", None)
      if isinstance(own, NamedSharding) and own.mesh == mesh:
        return own
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map(one, specs, values,
                                is_leaf=lambda x: isinstance(x, P))


def _follow_params(opt_state: Any, params: Any, shardings: Any, mesh: Mesh,
                   zero1: Optional[str]) -> Any:
  """The sharding of each leaf of ``opt_state``: a subtree shaped like the
  params (a master, a moment, the remainders) takes the params' shardings,
  with ``zero1`` added on top; any other array is split over ``zero1`` on
  its first divisible dimension (the flat layout's buffers) or replicated."""
  treedef = jax.tree_util.tree_structure(params)
  shapes = [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(params)]
  flat_shardings = treedef.flatten_up_to(shardings)

  def params_like(node) -> bool:
    try:
      leaves = treedef.flatten_up_to(node)
    except (ValueError, TypeError):
      return False
    return (jax.tree_util.tree_structure(node) == treedef and
            [tuple(np.shape(x)) for x in leaves] == shapes)

  def other(x):
    if zero1 is None or not np.shape(x):
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, _split_spec(tuple(np.shape(x)),
                                           mesh.shape[zero1], zero1))

  def assign(node):
    if params_like(node):
      out = []
      for sharding, shape in zip(flat_shardings, shapes):
        spec = sharding.spec
        if zero1 is not None:
          spec = _with_zero1(spec, shape, mesh, zero1)
        out.append(NamedSharding(mesh, spec))
      return treedef.unflatten(out)
    children, node_def = jax.tree_util.tree_flatten(
        node, is_leaf=lambda x: x is not node)  # one level down
    if node_def.num_nodes == 1 and node_def.num_leaves == 1:  # an array
      return other(node)
    return node_def.unflatten([assign(c) for c in children])

  return assign(opt_state)


def state_shardings(state: Any, mesh: Mesh, axis_name: Optional[str] = "data",
                    *, shard_optimizer_state: bool = True,
                    rules: Optional[Rules] = None,
                    params_shardings: Any = None) -> Any:
  """The layout of a :class:`~jmp_lab.TrainState` on ``mesh``.

  The params keep their own layout: ``params_shardings`` if given (a tree of
  ``NamedSharding`` or ``PartitionSpec`` like the params), else Flax's
  partition boxes on ``state.params`` (logical ones mapped by ``rules``),
  else the arrays' own shardings, else replicated (data parallelism). Every
  optimizer-state array shaped like the params (the fp32 master, the
  moments, the remainders) follows its param's sharding; with
  ``shard_optimizer_state`` it is also split over ``axis_name`` where its
  param is replicated along that axis (ZeRO-1). The rest (counters, the
  loss scale, the model state) is replicated, except the flat layout's
  buffers, split over ``axis_name``.

  Works on abstract states (``jax.eval_shape``), boxed or not: the result
  has the unboxed state's structure, and is a valid ``out_shardings`` for a
  jitted function returning the boxed state too.

  FSDP and tensor parallelism from Flax's logical axes (the distributed
  guide's MaxText-style example creates the state under ``jit`` with this
  layout as ``out_shardings``)::

    >>> import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, jmp_lab
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1),
    ...             ("fsdp", "tensor"))  # any sizes
    >>> dense = nn.Dense(8, kernel_init=nn.with_logical_partitioning(
    ...     nn.initializers.lecun_normal(), ("embed", "mlp")))
    >>> state = jax.eval_shape(lambda: jmp_lab.TrainState.create(
    ...     apply_fn=dense.apply, policy="mixed_bfloat16",
    ...     tx=jmp_lab.fused_adamw(1e-3, policy="mixed_bfloat16"),
    ...     params=dense.init(jax.random.key(0), jnp.ones((1, 16)))["params"]))
    >>> layout = state_shardings(state, mesh, None,
    ...                          shard_optimizer_state=False,
    ...                          rules=(("embed", "fsdp"), ("mlp", "tensor")))
    >>> layout.params["kernel"].spec, layout.opt_state.mu["kernel"].spec
    (P('fsdp', 'tensor'), P('fsdp', 'tensor'))
    >>> layout.params["bias"].spec   # not partitioned: replicated
    P()
  """
  _check_mesh(mesh)
  if axis_name is not None:
    _check_axis(mesh, axis_name)
  if not hasattr(state, "opt_state"):
    raise TypeError(f"state must be a jmp_lab.TrainState, got "
                    f"{type(state).__name__}; for an optimizer state alone "
                    f"use optimizer_state_shardings")
  if shard_optimizer_state and axis_name is None:
    raise ValueError("shard_optimizer_state=True needs the axis_name to "
                     "split the optimizer state over (ZeRO-1)")
  params = meta.unbox(state.params)
  if params_shardings is None:
    params_shardings = params_shardings_of(state.params, mesh, rules)
  else:
    treedef = jax.tree_util.tree_structure(params)
    try:
      flat = treedef.flatten_up_to(params_shardings)
    except (ValueError, TypeError) as e:
      raise ValueError(f"params_shardings must have the params' structure: "
                       f"{e}") from None
    params_shardings = treedef.unflatten([
        _as_sharding(s, mesh, f"leaf {i}") for i, s in enumerate(flat)])
  unboxed = meta.unbox(state)
  layout = replicated(unboxed, mesh).replace(params=params_shardings)
  return layout.replace(opt_state=_follow_params(
      unboxed.opt_state, params, params_shardings, mesh,
      axis_name if shard_optimizer_state else None))


def bytes_per_device(tree: Any) -> int:
  """Bytes of ``tree``'s arrays held by one device (its first shard each)."""
  return sum(leaf.addressable_shards[0].data.nbytes
             for leaf in jax.tree_util.tree_leaves(tree)
             if hasattr(leaf, "addressable_shards"))
