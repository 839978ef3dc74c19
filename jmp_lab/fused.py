"""``fused_adamw``: unscale + finite-gated AdamW + fp32 master + half copy.

Same semantics and state fields as
``mixed_precision(optax.adamw(...), policy=..., loss_scale=...)``, but the
update is done by Pallas kernels instead of the dozen tree-wide XLA ops of
the unfused path. Two state layouts:

* ``layout="tree"`` (default): master, ``mu`` and ``nu`` are trees like the
  params, updated by the multi-tensor kernels of
  :mod:`jmp_lab.kernels.multi_tensor` (16 leaves a launch, no packing): a
  statistics pass (finite flag and clip norm, 2 B/param with bf16
  gradients), then the update, in place: a few dozen update kernels where
  the unfused step has hundreds, for the same bytes (the compiled-for-H100
  figures are in ``benchmarks/RESULTS.md`` and the performance guide). With
  fp32 params
  ``backend="auto"`` keeps XLA's per-leaf fusion, which the kernel cannot
  beat there (see :func:`jmp_lab.kernels.tree_backend`). Under ``jit``
  with the state sharded (ZeRO-1, :func:`jmp_lab.sharding.state_shardings`)
  each device runs the kernels on its own shards of the leaves, with a
  global finite flag and clip norm (:mod:`jmp_lab.kernels.partitioned`).
* ``layout="flat"``: ``(rows, 256)`` fp32 buffers, padded to whole kernel
  blocks, one kernel for everything. Gradients that arrive as a tree are
  packed first (a pass); a model that reads its params from the flat buffer
  (:func:`flat_params`, :func:`unflatten_params`, or
  ``TrainState.create(..., flat_params=True)``) hands in flat gradients.
  Fewest launches, more bytes (the packing passes).

The memory-lean modes (``master="remainder"`` or ``"none"``, with nearest or
stochastic rounding; bf16 ``mu_dtype``/``nu_dtype``) run in the tree layout's
kernel, which then reads and writes only what the mode keeps: down to 6
B/param of params and state, and 16 B/param of update traffic
(:mod:`jmp_lab.kernels.multi_tensor`).

:func:`jmp_lab.master_params` returns the master as a tree in both layouts.
``update.new_params(grads, state, params)`` (the update is a
:class:`FusedUpdate`) returns the params the kernel wrote instead of an
``updates`` tree; ``TrainState`` uses it.

Example::

  >>> import jax.numpy as jnp, optax, jmp_lab
  >>> tx = jmp_lab.fused_adamw(1e-3, policy="p=bf16,c=bf16,o=f32",
  ...                          loss_scale=jmp_lab.DynamicLossScale())
  >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> scaled_grads = jmp_lab.ScaledGradients(
  ...     {"w": jnp.full((4, 4), 2.0**15, jnp.bfloat16)})
  >>> updates, state = tx.update(scaled_grads, state, params)
  >>> params = optax.apply_updates(params, updates)
  >>> master = jmp_lab.master_params(state)["w"]
  >>> bool(jnp.all(params["w"] == master.astype(jnp.bfloat16)))
  True
"""

from jmp_lab._src.optim.fused_adamw import FusedUpdate, fused_adamw
from jmp_lab._src.optim.fused_flat import flat_params, unflatten_params

from jmp_lab._src.optim import fused_adamw as _impl

#: The state layouts of :func:`fused_adamw`: ``"tree"`` and ``"flat"``.
LAYOUTS = _impl.LAYOUTS

__all__ = ["FusedUpdate", "LAYOUTS", "flat_params", "fused_adamw",
           "unflatten_params"]
