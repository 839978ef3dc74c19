"""Fused optimizer kernels and the backend chooser.

(The package also holds :mod:`.linear_cross_entropy`, the Pallas kernels of
:func:`jmp_lab.losses.linear_cross_entropy`, which that function chooses.)

Backends, one per file:

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
anything else uses the reference. Compiled for an H100, the Triton kernel
moves 28 B/param in place; the Mosaic kernel plus its copies moves 56
(benchmarks/RESULTS.md).

An explicit GPU backend is taken as asked, wherever the step is compiled, so
it can be compiled for a GPU on a machine without one; running it on a CPU
fails when the step is lowered.

**When Triton goes.** jax 0.11 deprecates Pallas' Triton backend (it warns
at every lowering of a Triton kernel; jmp_lab filters that one message once
it builds one: :func:`quiet_triton_deprecation`). If a jax cannot import
``jax.experimental.pallas.triton``, ``"auto"`` falls back by itself: the
flat layout to the Mosaic GPU kernel (Hopper), the tree layout (whose
multi-tensor kernel is Triton only) to XLA's own fusion, the reference. An
explicit ``backend="triton"`` is refused with a ``ValueError`` naming the
module. ``tests/test_kernels.py`` hides the module and checks all three.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Optional

import jax

from jmp_lab.kernels import multi_tensor, pallas_triton, partitioned, reference
from jmp_lab.kernels.reference import AdamWConfig, Outputs

logger = logging.getLogger("jmp_lab")

BACKENDS = ("auto", "mosaic", "triton", "interpret", "reference")


def importable(module: str) -> bool:
  """Whether ``module`` imports here (the Pallas GPU modules come and go
  with jax versions: Triton's is deprecated in 0.11)."""
  try:
    __import__(module)
    return True
  except ImportError:
    return False


_GPU_MODULES = {"triton": "jax.experimental.pallas.triton",
                "mosaic": "jax.experimental.pallas.mosaic_gpu"}


def available_backends() -> tuple[str, ...]:
  """The backends this installation can build a step with."""
  found = [b for b in ("triton", "mosaic") if importable(_GPU_MODULES[b])]
  return tuple(found) + ("interpret", "reference")


def resolve_backend(backend: str) -> str:
  """Checks a backend name (``"auto"`` is resolved when the step is lowered).

  Raises:
    ValueError: for an unknown name, or a GPU backend whose Pallas module
      this jax cannot import.
  """
  if backend not in BACKENDS:
    raise ValueError(
        f"unknown fused backend {backend!r}; accepted: {', '.join(BACKENDS)}")
  if backend != "auto" and backend not in available_backends():
    raise ValueError(
        f"fused backend {backend!r} needs {_GPU_MODULES[backend]}, which this "
        f"jax {jax.__version__} cannot import; available: "
        f"{', '.join(available_backends())}")
  return backend


# The exact text jax 0.11 warns with when it lowers a Triton kernel.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be "
                      r"removed in a future JAX version\.")


@functools.cache
def quiet_triton_deprecation() -> None:
  """Ignores jax 0.11's Triton deprecation warning, once jmp_lab builds a
  Triton kernel: only that message, only as a DeprecationWarning.

  jax warns when the kernel is lowered, which is when the jit around the
  whole step compiles, after jmp_lab's call has returned: a filter scoped to
  the call cannot see it, so this one lasts for the process, and a process
  that never builds a Triton kernel never installs it.
  """
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION,
                          category=DeprecationWarning)


def leading_mesh_axes(sharding) -> tuple:
  """The mesh axes that split an operand's first axis (its tokens or rows),
  read from a ``NamedSharding``; ``()`` when it is whole. Shared by the
  kernels' ``custom_partitioning`` rules, which split by that axis."""
  spec = getattr(sharding, "spec", None)
  if not spec or spec[0] is None:
    return ()
  return tuple(spec[0]) if isinstance(spec[0], tuple) else (spec[0],)


def split_over(mesh, axes: tuple, ndim: int, dim: int = 0):
  """The ``NamedSharding`` of an ``ndim``-dimensional array whose axis
  ``dim`` is split over the mesh ``axes`` (whole when there are none)."""
  from jax.sharding import NamedSharding, PartitionSpec
  entry = (axes if len(axes) > 1 else axes[0]) if axes else None
  spec = [None] * ndim
  if ndim:
    spec[dim] = entry
  return NamedSharding(mesh, PartitionSpec(*spec))


def _local_gpu_capability() -> Optional[float]:
  for device in jax.local_devices():
    if device.platform == "gpu":
      capability = getattr(device, "compute_capability", None)
      return None if capability is None else float(capability)
  return None


def cuda_backend() -> str:
  """The kernel ``"auto"`` puts in a step compiled for CUDA."""
  capability = _local_gpu_capability()
  if capability is not None and capability < 8.0:
    return "reference"
  for backend in ("triton", "mosaic"):
    if backend in available_backends() and (
        backend != "mosaic" or capability is None or capability >= 9.0):
      return backend
  return "reference"


def fused_update(backend: str, config: AdamWConfig, g, p, mu, nu, hyper,
                 flags) -> Outputs:
  """Runs the fused update with ``backend`` (see the module doc)."""
  args = (g, p, mu, nu, hyper, flags)
  if backend == "auto":
    chosen = cuda_backend()
    logger.info("jmp_lab fused update: %r when compiled for CUDA, reference "
                "elsewhere", chosen)
    return jax.lax.platform_dependent(
        *args,
        cuda=lambda *a: _run(chosen, config, *a),
        default=lambda *a: _run("reference", config, *a))
  return _run(backend, config, *args)


def tree_grad_stats(backend: str, grads, scale):
  """``(sum of squares, all finite)`` of the unscaled gradient leaves."""
  if backend == "auto":
    chosen = _tree_cuda_backend()
    return jax.lax.platform_dependent(
        grads, scale,
        cuda=lambda g, s: _tree_stats(chosen, g, s),
        default=lambda g, s: _tree_stats("reference", g, s))
  return _tree_stats(backend, grads, scale)


def tree_update(backend: str, config: AdamWConfig, decays, g, p, mu, nu,
                hyper, flags, *, write_extra: bool, remainders=None) -> Outputs:
  """The fused update over lists of leaves (the tree layout); with
  ``config.remainder`` see :func:`reference.tree_update`."""
  def run(chosen, *args):
    return _tree_run(chosen, config, decays, *args, write_extra=write_extra)
  args = (g, p, mu, nu, hyper, flags, remainders)
  if backend == "auto":
    chosen = _tree_cuda_backend()
    logger.info("jmp_lab multi-tensor update: %r when compiled for CUDA, "
                "reference elsewhere", chosen)
    return jax.lax.platform_dependent(
        *args, cuda=lambda *a: run(chosen, *a),
        default=lambda *a: run("reference", *a))
  return run(backend, *args)


def tree_step(backend: str, config: AdamWConfig, decays, g, p, mu, nu,
              remainders, scale, scalars_fn, scalar_args, *,
              write_extra: bool, partitionable: bool = True):
  """``(Outputs, finite)``: the statistics over the gradient leaves,
  ``scalars_fn(sumsq, finite, scalar_args) -> (hyper, flags, finite)``, and
  the update, as one op XLA's partitioner splits leaf by leaf
  (:mod:`.partitioned`). The reference backend is XLA's own ops, which it
  partitions anyway."""
  plan = partitioned.StepPlan(
      run_stats=lambda grads, s: tree_grad_stats(backend, grads, s),
      scalars_fn=scalars_fn,
      run_update=lambda g, p, mu, nu, hyper, flags, rem: tree_update(
          backend, config, decays, g, p, mu, nu, hyper, flags,
          write_extra=write_extra, remainders=rem),
      leaves=len(g), remainders=remainders is not None,
      result_groups=4 if (not config.direct and (write_extra
                                                 or config.remainder)) else 3,
      stochastic=config.stochastic)
  return partitioned.tree_step(
      plan, g, p, mu, nu, remainders, scale, scalar_args,
      partitionable=partitionable and backend != "reference")


def tree_backend(backend: str, *, half_params: bool) -> str:
  """The backend the tree layout runs for ``backend``.

  ``"auto"`` keeps XLA's own per-leaf fusion (the reference) when the params
  are fp32: compiled for an H100, XLA's update there reads the bf16 GEMM
  outputs and never writes fp32 gradients (28.0 B/param on GPT-2-small),
  while the kernel must be handed fp32 gradient leaves (38.9 B/param, and
  the step moves 73.3 GB against 71.7). With half params and an fp32 master
  the kernel wins: 30.0 against 32.0 B/param (benchmarks/RESULTS.md).
  """
  return "reference" if backend == "auto" and not half_params else backend


def _tree_cuda_backend() -> str:
  """The multi-tensor kernel is Triton only. ``cuda_backend`` prefers Triton,
  so "mosaic" there means Triton cannot be imported: use the reference."""
  chosen = cuda_backend()
  return "reference" if chosen == "mosaic" else chosen


def _tree_stats(backend: str, grads, scale):
  if backend == "triton":
    quiet_triton_deprecation()
  if backend == "reference":
    return reference.tree_grad_stats(grads, scale)
  if backend in ("interpret", "triton"):
    return multi_tensor.grad_stats(grads, scale,
                                   interpret=backend == "interpret")
  raise ValueError(f"the tree layout has no {backend!r} backend")


def _tree_run(backend: str, config: AdamWConfig, decays, g, p, mu, nu, hyper,
              flags, remainders, *, write_extra: bool) -> Outputs:
  if backend == "triton":
    quiet_triton_deprecation()
  if backend == "reference":
    return reference.tree_update(config, decays, g, p, mu, nu, hyper, flags,
                                 write_extra=write_extra,
                                 remainders=remainders)
  if backend in ("interpret", "triton"):
    return multi_tensor.update(config, decays, g, p, mu, nu, hyper, flags,
                               write_extra=write_extra,
                               interpret=backend == "interpret",
                               remainders=remainders)
  raise ValueError(f"the tree layout has no {backend!r} backend")


def _run(backend: str, config: AdamWConfig, g, p, mu, nu, hyper, flags
         ) -> Outputs:
  if backend == "triton":
    quiet_triton_deprecation()
  if backend == "reference":
    return reference.fused_update(config, g, p, mu, nu, hyper, flags)
  if backend in ("interpret", "triton"):
    return pallas_triton.fused_update(config, g, p, mu, nu, hyper, flags,
                                      interpret=backend == "interpret")
  if backend == "mosaic":
    from jmp_lab.kernels import mosaic  # imports plgpu: GPU builds only
    return mosaic.fused_update(config, g, p, mu, nu, hyper, flags)
  raise ValueError(f"unresolved fused backend {backend!r}")


__all__ = ["AdamWConfig", "BACKENDS", "Outputs", "TRITON_DEPRECATION",
           "available_backends", "cuda_backend", "fused_update", "importable",
           "quiet_triton_deprecation", "resolve_backend",
           "tree_backend", "tree_grad_stats", "tree_update"]
