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

from jmp_lab.kernels import layout as layout_lib
from jmp_lab.kernels import quantized

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


def _where(path) -> str:
  return jax.tree_util.keystr(path) or "the params"


def _checked_sharding(value: Any, mesh: Mesh, path, ndim: int
                      ) -> NamedSharding:
  """A given param's sharding: a ``NamedSharding`` on ``mesh`` or a
  ``PartitionSpec``, no longer than the param's rank, naming only the
  mesh's axes."""
  if isinstance(value, P):
    value = NamedSharding(mesh, value)
  elif not isinstance(value, NamedSharding):
    raise TypeError(f"params_shardings must hold NamedShardings or "
                    f"PartitionSpecs, got {value!r} at {_where(path)}")
  elif value.mesh != mesh:
    raise ValueError(f"params_shardings at {_where(path)} is on another "
                     f"mesh ({dict(value.mesh.shape)}) than mesh "
                     f"({dict(mesh.shape)}): give PartitionSpecs, or "
                     f"NamedShardings on mesh")
  _check_spec(value.spec, mesh, path, ndim, "params_shardings")
  return value


def _check_spec(spec: P, mesh: Mesh, path, ndim: int, source: str) -> None:
  if len(spec) > ndim:
    raise ValueError(f"{source} gives {_where(path)} (rank {ndim}) the "
                     f"spec {spec}, with more entries than dimensions")
  missing = [a for e in spec for a in _axes_of(e) if a not in mesh.shape]
  if missing:
    raise ValueError(f"{source} splits {_where(path)} over {missing}, "
                     f"which the mesh does not have (its axes: "
                     f"{', '.join(map(repr, mesh.axis_names))}); map the "
                     f"logical axes to the mesh's in rules, or leave them "
                     f"unmapped (None)")


def _is_box(x: Any) -> bool:
  return isinstance(x, meta.AxisMetadata)


def params_shardings_of(params: Any, mesh: Mesh,
                        rules: Optional[Rules] = None) -> Any:
  """The sharding of each param (an unboxed tree of ``NamedSharding``).

  From Flax's partition boxes where ``params`` has them
  (``nn.with_partitioning`` names mesh axes; ``nn.with_logical_partitioning``
  names logical axes, which ``rules`` map to mesh axes, as
  ``nn.logical_axis_rules`` does; the two may be mixed); else from the
  arrays' own ``NamedSharding`` on ``mesh``; else replicated.
  """
  _check_mesh(mesh)
  leaves = jax.tree_util.tree_leaves(params, is_leaf=_is_box)
  if any(isinstance(x, nn.LogicallyPartitioned) for x in leaves):
    if rules is None:
      rules = nn.get_logical_axis_rules()
    if not rules:
      raise ValueError(
          "the params are logically partitioned (nn.with_logical_partitioning) "
          "but no rules map their logical axes to the mesh's: pass "
          "rules=[('embed', 'fsdp'), ...] or set nn.logical_axis_rules")

  def one(path, leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      # only logical names go through the rules: nn.Partitioned's already
      # name mesh axes
      spec = nn.logical_to_mesh_axes(leaf.names, rules)
    elif isinstance(leaf, nn.Partitioned):
      spec = P(*leaf.names)
    else:
      own = getattr(leaf, "sharding", None)
      if isinstance(own, NamedSharding) and own.mesh == mesh:
        return own
      spec = P()
    value = leaf.unbox() if _is_box(leaf) else leaf
    _check_spec(spec, mesh, path, np.ndim(value),
                "the params' partition boxes")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_box)


def _follow_params(opt_state: Any, params: Any, shardings: Any, mesh: Mesh,
                   zero1: Optional[str]) -> Any:
  """The sharding of each leaf of ``opt_state``.

  A leaf whose path ends with a param's path and has its shape (that
  param's master, moments, remainder; also inside ``optax.masked`` or
  ``multi_transform`` states) takes the param's sharding, with ``zero1``
  added on top. Other arrays with two or more dimensions (the flat
  layout's buffers) are split over ``zero1`` on their first divisible
  dimension; the rest (counters, keys, scales) is replicated.
  """
  by_path = {tuple(path): (tuple(np.shape(x)), sharding.spec)
             for (path, x), sharding in zip(
                 jax.tree_util.tree_flatten_with_path(params)[0],
                 jax.tree_util.tree_leaves(shardings))}

  def param_spec(path, shape) -> Optional[P]:
    # the longest param path the leaf's path ends with: ['Dense_0']['kernel']
    # before ['kernel']
    for start in range(len(path) + 1):
      param_shape, spec = by_path.get(path[start:], (None, None))
      if param_shape == shape:
        return spec
    return None

  def quantized_part(path, shape) -> Optional[P]:
    """An 8-bit moment's codes or scales (a ``QuantizedMoment``, or the
    State NNX makes of one) take their param's spec, with ZeRO-1 decided
    on the blocks' shape, so both split alike and in whole blocks."""
    if not path or _key_name(path[-1]) not in quantized.QuantizedMoment._fields:
      return None
    for start in range(len(path)):
      param_shape, spec = by_path.get(tuple(path[start:-1]), (None, None))
      block = quantized.block_size(param_shape) if param_shape else None
      if block and len(param_shape) == len(shape) and (
          param_shape[:-1] == shape[:-1]):
        cut = quantized.blocks_cut(
            "param " + jax.tree_util.keystr(tuple(path[start:-1])),
            param_shape, block, spec, mesh)
        if cut:
          raise ValueError(cut)
        blocks_shape = param_shape[:-1] + (param_shape[-1] // block,)
        return spec if zero1 is None else _with_zero1(spec, blocks_shape,
                                                       mesh, zero1)
    return None

  def one(path, x):
    shape = tuple(np.shape(x))
    spec = quantized_part(tuple(path), shape)
    if spec is not None:
      return NamedSharding(mesh, spec)
    spec = param_spec(tuple(path), shape)
    if spec is not None:
      if zero1 is not None:
        spec = _with_zero1(spec, shape, mesh, zero1)
      return NamedSharding(mesh, spec)
    if zero1 is None or len(shape) < 2:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, _split_spec(shape, mesh.shape[zero1], zero1))

  return jax.tree_util.tree_map_with_path(one, opt_state)


def _key_name(key: Any) -> Any:
  """The name in a path entry (a dict key, an attribute)."""
  return getattr(key, "name", getattr(key, "key", None))


def _has_flat_buffers(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds ``fused_adamw(layout="flat")``'s buffers
  (every param's state packed in one array, which cannot follow the
  params' shardings)."""
  nodes = jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(getattr(x, "layout", None),
                                              layout_lib.FlatLayout))
  return any(isinstance(getattr(x, "layout", None), layout_lib.FlatLayout)
             for x in nodes)


def state_shardings(state: Any, mesh: Mesh, axis_name: Optional[str] = "data",
                    *, shard_optimizer_state: bool = True,
                    rules: Optional[Rules] = None,
                    params_shardings: Any = None) -> Any:
  """The layout of a :class:`~jmp_lab.TrainState` on ``mesh``.

  The params keep their own layout: ``params_shardings`` if given (a tree of
  ``NamedSharding`` or ``PartitionSpec`` like the params), else Flax's
  partition boxes on ``state.params`` (logical ones mapped by ``rules``, or
  by the ``nn.logical_axis_rules`` in effect), else the arrays' own
  shardings, else replicated (data parallelism). Every optimizer-state
  array of a param's shape at that param's path (the fp32 master, the
  moments, the remainders) follows its param's sharding; with
  ``shard_optimizer_state`` and an ``axis_name`` it is also split over
  ``axis_name`` where its param is replicated along that axis (ZeRO-1;
  ``axis_name=None``: none). The rest (counters, keys, the loss scale, the
  model state) is replicated, except the flat layout's buffers, split over
  ``axis_name`` (the flat layout is data parallel only: with sharded params
  it is refused).

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
    >>> layout = state_shardings(state, mesh, None,   # no data axis: no ZeRO-1
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
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(
        params)[0]]
    params_shardings = treedef.unflatten([
        _checked_sharding(s, mesh, path, np.ndim(x))
        for s, path, x in zip(flat, paths, treedef.flatten_up_to(params))])
  unboxed = meta.unbox(state)
  sharded = [s.spec for s in jax.tree_util.tree_leaves(params_shardings)
             if s.spec != P()]
  if sharded and _has_flat_buffers(unboxed.opt_state):
    raise ValueError(
        "fused_adamw(layout='flat') packs every param's state into one "
        "buffer, which cannot follow sharded params (FSDP, tensor "
        "parallelism); use the default layout='tree', whose state follows "
        "each param's sharding")
  layout = replicated(unboxed, mesh).replace(params=params_shardings)
  return layout.replace(opt_state=_follow_params(
      unboxed.opt_state, params, params_shardings, mesh,
      axis_name if shard_optimizer_state else None))


def nnx_optimizer_shardings(model: Any, optimizer: Any, mesh: Mesh,
                            axis_name: Optional[str] = None) -> Any:
  """The ``NamedSharding`` of every array of an NNX optimizer's state: each
  array shaped like a param (the master, moments, remainders) as its param,
  with ZeRO-1 over ``axis_name`` on top where the param is replicated along
  it (None: none); the rest (counters, the loss scale, keys) replicated.

  NNX's counterpart of :func:`state_shardings`. The params' layout comes
  from their Variables' sharding metadata (``nnx.with_partitioning``,
  ``out_sharding``: read by Flax's ``nnx.get_named_sharding``), else from
  their arrays' own ``NamedSharding`` on ``mesh``. Works with Flax's
  ``nnx.Optimizer`` and :class:`jmp_lab.nnx.Optimizer`, whatever the
  transformation inside. The result has the structure of
  ``nnx.state(optimizer, nnx.OptState)``, as ``jax.device_put``,
  ``jax.lax.with_sharding_constraint`` and ``nnx.jit``'s ``out_shardings``
  take it.

  Example (ZeRO-1 over a data axis on top of FSDP)::

    >>> import jax, jax.numpy as jnp, optax, jmp_lab
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1, 1), ("data", "fsdp"))
    >>> with jax.set_mesh(mesh):
    ...   model = nnx.Linear(4, 8, rngs=nnx.Rngs(0), kernel_init=
    ...       nnx.with_partitioning(nnx.initializers.lecun_normal(),
    ...                             (None, "fsdp")))
    ...   optimizer = nnx.Optimizer(model, jmp_lab.mixed_precision(
    ...       optax.adam(1e-3), policy="mixed_bfloat16"), wrt=nnx.Param)
    >>> shardings = nnx_optimizer_shardings(model, optimizer, mesh, "data")
    >>> shardings["opt_state"]["inner_state"][0]["mu"]["kernel"].spec
    P('data', 'fsdp')
    >>> with jax.set_mesh(mesh):
    ...   nnx.update(optimizer, jax.device_put(
    ...       nnx.state(optimizer, nnx.OptState), shardings))
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel
  _check_mesh(mesh)
  if axis_name is not None:
    _check_axis(mesh, axis_name)
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got "
                    f"{type(model).__name__}")
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f"optimizer must be an nnx.Optimizer (Flax's or "
                    f"jmp_lab.nnx.Optimizer), got {type(optimizer).__name__}")
  params = nnx.state(model, optimizer.wrt)
  values = nnx.as_pure(params)
  from_metadata = nnx.as_pure(nnx.get_named_sharding(params, mesh))

  def own_or_metadata(value, sharding):
    own = getattr(value, "sharding", None)
    if (sharding.spec == P() and isinstance(own, NamedSharding)
        and own.mesh == mesh):
      return NamedSharding(mesh, _spec(list(own.spec)))  # P(None,) is P()
    return sharding

  params_shardings = jax.tree_util.tree_map(own_or_metadata, values,
                                            from_metadata)
  return _follow_params(nnx.as_pure(nnx.state(optimizer, nnx.OptState)),
                        values, params_shardings, mesh, axis_name)


def bytes_per_device(tree: Any) -> int:
  """Bytes of ``tree``'s arrays held by one device (its first shard each)."""
  return sum(leaf.addressable_shards[0].data.nbytes
             for leaf in jax.tree_util.tree_leaves(tree)
             if hasattr(leaf, "addressable_shards"))
