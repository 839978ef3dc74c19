"""Fused optimizer kernels and the backend chooser.

(The package also holds :mod:`.linear_cross_entropy`, the Pallas kernels of
:func:`jmp_lab.losses.linear_cross_entropy`, which that function chooses.)

The backends (:mod:`.registry` holds their table and decides ``"auto"``),
one per file:

* ``"triton"`` (:mod:`.pallas_triton`) -- Pallas' Triton backend, for NVIDIA
  GPUs of compute capability >= 8.0 (deprecated upstream in jax 0.11, still
  present); it updates the master and moments in place;
* ``"mosaic"`` (:mod:`.mosaic`) -- Mosaic GPU / ``plgpu``, for Hopper
  (compute capability >= 9.0); ``plgpu.kernel`` cannot alias its outputs to
  its inputs, so a donated state costs three extra copies;
* ``"interpret"`` (:mod:`.pallas_triton`) -- the Triton kernel in interpret
  mode, on any device (slow; for tests);
* ``"reference"`` (:mod:`.reference`) -- plain jnp, the fallback everywhere.

``"auto"`` decides by the platform the step is *compiled for*
(``jax.lax.platform_dependent``), not by the first local device: a step
compiled for CUDA -- on a GPU machine, or ahead of time on a CPU-only one --
contains the Pallas kernel (Triton where it can be imported, else Mosaic GPU;
on a local GPU older than Ampere, the reference), and a step compiled for
anything else uses the reference. The Triton kernel updates in place; the
Mosaic kernel's copies roughly double its bytes (``benchmarks/RESULTS.md``).

An explicit GPU backend is taken as asked, wherever the step is compiled, so
it can be compiled for a GPU on a machine without one; running it on a CPU
fails when the step is lowered.

**When Triton goes.** jax 0.11 deprecates Pallas' Triton backend (it warns
at every lowering of a Triton kernel; jmp_lab filters that one message once
it builds one: :func:`.platform.quiet_triton_deprecation`). If a jax cannot import
``jax.experimental.pallas.triton``, ``"auto"`` falls back by itself: the
flat layout to the Mosaic GPU kernel (Hopper), the tree layout (whose
multi-tensor kernel is Triton only) to XLA's own fusion, the reference. An
explicit ``backend="triton"`` is refused with a ``ValueError`` naming the
module. ``tests/test_kernels.py`` hides the module and checks all three.
"""

import importlib

from jmp_lab.kernels import multi_tensor, pallas_triton, reference, registry
from jmp_lab.kernels.partitioned import backend_tree_step as tree_step
from jmp_lab.kernels.reference import AdamWConfig, Outputs
from jmp_lab.kernels.registry import (fused_update,
                                      tree_backend, tree_grad_stats,
                                      tree_update)
from jmp_lab.kernels.registry import available as available_backends
from jmp_lab.kernels.registry import for_cuda as cuda_backend
from jmp_lab.kernels.registry import resolve as resolve_backend


def _mosaic_update(*args):
  # plgpu is imported only where a Mosaic GPU kernel is built.
  return importlib.import_module("jmp_lab.kernels.mosaic").fused_update(*args)


# The backends' rows (jmp_lab.kernels.registry): each layout's kernels.
registry.register("reference", flat=reference.fused_update,
                  tree_stats=reference.tree_grad_stats,
                  tree_update=reference.tree_update)
for _name, _interpret in (("interpret", True), ("triton", False)):
  registry.register(
      _name, flat=pallas_triton.flat_update(_interpret),
      tree_stats=multi_tensor.stats_fn(_interpret),
      tree_update=multi_tensor.update_fn(_interpret))
registry.register("triton", module="jax.experimental.pallas.triton",
                  min_capability=8.0, triton=True)
registry.register("mosaic", module="jax.experimental.pallas.mosaic_gpu",
                  min_capability=9.0, flat=_mosaic_update)

#: The backend names :func:`fused_update` and the optimizers take:
#: ``"auto"``, ``"mosaic"``, ``"triton"``, ``"interpret"``,
#: ``"reference"``.
BACKENDS = registry.NAMES

__all__ = ["AdamWConfig", "BACKENDS", "Outputs", "available_backends",
           "cuda_backend", "fused_update", "resolve_backend", "tree_backend",
           "tree_grad_stats", "tree_step", "tree_update"]
