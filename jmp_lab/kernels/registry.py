"""The fused-update backends, and the one place that decides ``"auto"``.

Each backend is a row of :data:`BACKENDS`: the Pallas module it needs, its
flat-layout update, and its tree-layout (multi-tensor) statistics and
update. The backend modules register their rows (:func:`register`;
``jmp_lab.kernels`` imports them all), so this table depends on none of
them. ``"auto"`` is resolved here, for the platform a step is compiled for
(``jax.lax.platform_dependent``): on CUDA the first backend of
:data:`CUDA_ORDER` this installation and GPU can run for the layout, the
reference elsewhere. A new backend is a new module that registers its row.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import jax

from jmp_lab import _compat as compat
from jmp_lab.kernels import mesh as mesh_lib
from jmp_lab.kernels import platform

logger = logging.getLogger("jmp_lab")


@dataclasses.dataclass(frozen=True)
class Backend:
  """One fused-update backend.

  Attributes:
    name: its name.
    module: the Pallas module it needs (None: always available).
    min_capability: the GPU compute capability it needs on CUDA.
    flat: ``(config, g, p, mu, nu, hyper, flags) -> Outputs`` (None: no
      flat layout).
    tree_stats: ``(grads, scale) -> (sum of squares, all finite)`` (None:
      no tree layout).
    tree_update: ``(config, decays, g, p, mu, nu, hyper, flags, *,
      write_extra, remainders) -> Outputs``.
    triton: it lowers Triton kernels (jax 0.11 warns: quieted).
  """

  name: str
  module: Optional[str] = None
  min_capability: float = 0.0
  flat: Optional[Callable] = None
  tree_stats: Optional[Callable] = None
  tree_update: Optional[Callable] = None
  triton: bool = False


BACKENDS: dict[str, Backend] = {}


def register(name: str, **fields) -> None:
  """Adds ``fields`` to backend ``name``'s row (a backend module registers
  its layouts: the flat kernel and the multi-tensor kernels are two
  modules)."""
  row = BACKENDS.get(name, Backend(name))
  BACKENDS[name] = dataclasses.replace(row, **fields)


NAMES = ("auto", "mosaic", "triton", "interpret", "reference")
# The order "auto" tries on CUDA (the reference always runs).
CUDA_ORDER = ("triton", "mosaic", "reference")


def available() -> tuple[str, ...]:
  """The backends this installation can build a step with."""
  return tuple(name for name in ("triton", "mosaic", "interpret", "reference")
               if BACKENDS[name].module is None
               or platform.importable(BACKENDS[name].module))


def resolve(name: str) -> str:
  """Checks a backend name (``"auto"`` is resolved when the step is lowered).

  Raises:
    ValueError: for an unknown name, or a GPU backend whose Pallas module
      this jax cannot import.
  """
  if name not in NAMES:
    raise ValueError(
        f"unknown fused backend {name!r}; accepted: {', '.join(NAMES)}")
  if name != "auto" and name not in available():
    raise ValueError(
        f"fused backend {name!r} needs {BACKENDS[name].module}, which this "
        f"jax {compat.JAX_VERSION} cannot import; available: "
        f"{', '.join(available())}")
  return name


def for_cuda(layout: str = "flat") -> str:
  """The backend ``"auto"`` puts in a step compiled for CUDA, for the
  ``"flat"`` or ``"tree"`` layout: the first of :data:`CUDA_ORDER` that
  this installation can import, that the local GPU (if any) can run, and
  that has the layout."""
  capability = platform.local_gpu_capability()
  for name in CUDA_ORDER:
    backend = BACKENDS[name]
    runs = capability is None or capability >= backend.min_capability
    has_layout = (backend.flat if layout == "flat" else backend.tree_update)
    if name in available() and runs and has_layout is not None:
      return name
  return "reference"


def _on_cuda_else_reference(name: str, layout: str, run: Callable, *args):
  """``run(backend, *args)`` with ``name``, ``"auto"`` resolved by the
  platform the step is compiled for.

  ``"auto"`` with arrays sharded in their type (a mesh with explicit axes,
  as NNX's eager sharding under ``jax.set_mesh`` makes them) runs the
  reference, which XLA partitions: a Pallas ref cannot be sliced along a
  sharded axis, so the kernel could not even be traced there."""
  if name == "auto" and any(mesh_lib.explicitly_sharded(x)
                            for x in jax.tree_util.tree_leaves(args)):
    logger.info("jmp_lab %s update: the reference, for arrays sharded in "
                "their type", layout)
    return run(BACKENDS["reference"], *args)
  if name in GPU_ONLY:
    return _on_cuda_only(BACKENDS[name], run, *args)
  if name != "auto":
    return run(BACKENDS[name], *args)
  chosen = BACKENDS[for_cuda(layout)]
  logger.info("jmp_lab %s update: %r when compiled for CUDA, reference "
              "elsewhere", layout, chosen.name)
  return jax.lax.platform_dependent(
      *args, cuda=lambda *a: run(chosen, *a),
      default=lambda *a: run(BACKENDS["reference"], *a))


# Backends whose kernels only an NVIDIA GPU runs: named explicitly, a step
# compiled for another platform is refused with jmp_lab's own error.
GPU_ONLY = ("triton", "mosaic")


def _refusal_message(backend: str, platform_name: str) -> str:
  return (f"fused backend {backend!r} runs its Pallas kernel on an NVIDIA "
          f"GPU only, and this step is being compiled for "
          f"{platform_name!r}; pass backend='auto' (the kernel on a GPU, "
          f"XLA's reference update elsewhere), 'reference', or 'interpret' "
          f"(the Pallas kernel interpreted on the CPU, for tests)")


def _refuse_lowering(ctx, *args, backend, out_avals):
  del args, out_avals
  platforms = getattr(ctx.module_context, "platforms", None) or ("this",)
  raise ValueError(_refusal_message(backend, ", ".join(platforms)))


def _refuse_eagerly(*args, backend, out_avals):
  del args, out_avals
  raise ValueError(_refusal_message(backend, jax.default_backend()))


@functools.lru_cache(maxsize=None)
def _refused_primitive():
  """A primitive that stands for a GPU-only kernel on other platforms: it
  traces (its outputs' types are the kernel's); lowering it, or running it
  op by op, raises :func:`_refusal_message`'s error."""
  from jax.extend import core as jex_core
  from jax.interpreters import mlir
  primitive = jex_core.Primitive("jmp_lab_gpu_only_backend")
  primitive.multiple_results = True
  primitive.def_abstract_eval(lambda *args, backend, out_avals: out_avals)
  primitive.def_impl(_refuse_eagerly)
  mlir.register_lowering(primitive, _refuse_lowering)
  return primitive


def _on_cuda_only(backend: Backend, run: Callable, *args):
  """``run(backend, *args)`` where the step is compiled for CUDA; compiled
  for any other platform, a ValueError that names the backend, the
  platform and what to pass instead (Pallas' own is an internal one)."""
  kernel = lambda *a: run(backend, *a)  # noqa: E731
  traced = jax.make_jaxpr(kernel, return_shape=True)(*args)
  out_avals, shapes = tuple(traced[0].out_avals), traced[1]

  def refused(*a):
    outs = _refused_primitive().bind(*jax.tree_util.tree_leaves(a),
                            backend=backend.name, out_avals=out_avals)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shapes), outs)

  return jax.lax.platform_dependent(*args, cuda=kernel, default=refused)


def _quieted(backend: Backend) -> Backend:
  if backend.triton:
    platform.quiet_triton_deprecation()
  return backend


def fused_update(name: str, config, g, p, mu, nu, hyper, flags):
  """The flat-layout update with backend ``name``."""
  def run(backend, *args):
    if _quieted(backend).flat is None:
      raise ValueError(f"the flat layout has no {backend.name!r} backend")
    return backend.flat(config, *args)
  return _on_cuda_else_reference(name, "flat", run, g, p, mu, nu, hyper, flags)


def tree_grad_stats(name: str, grads, scale):
  """``(sum of squares, all finite)`` of the unscaled gradient leaves."""
  def run(backend, *args):
    if _quieted(backend).tree_stats is None:
      raise ValueError(f"the tree layout has no {backend.name!r} backend")
    return backend.tree_stats(*args)
  return _on_cuda_else_reference(name, "tree", run, grads, scale)


def tree_update(name: str, config, decays, g, p, mu, nu, hyper, flags, *,
                write_extra: bool, remainders=None, index_maps=None):
  """The multi-tensor update over lists of leaves (the tree layout).

  ``index_maps``: when the leaves are shards, a ``(global shape, base)``
  per leaf, for stochastic rounding's element indices (see
  :func:`jmp_lab.kernels.rounding.global_index`)."""
  global_shapes = (None if index_maps is None
                   else [shape for shape, _ in index_maps])
  bases = None if index_maps is None else [base for _, base in index_maps]

  def run(backend, *args):
    if _quieted(backend).tree_update is None:
      raise ValueError(f"the tree layout has no {backend.name!r} backend")
    *args, remainders, bases = args
    maps = (None if bases is None else list(zip(global_shapes, bases)))
    return backend.tree_update(config, decays, *args,
                               write_extra=write_extra, remainders=remainders,
                               index_maps=maps)
  return _on_cuda_else_reference(name, "tree", run, g, p, mu, nu, hyper,
                                 flags, remainders, bases)


def tree_backend(name: str, *, half_params: bool) -> str:
  """The backend the tree layout runs for ``name``.

  ``"auto"`` keeps XLA's own per-leaf fusion (the reference) when the params
  are fp32: compiled for an H100, XLA's update there reads the bf16 GEMM
  outputs and never writes fp32 gradients, while the kernel must be handed
  fp32 gradient leaves; with half params and an fp32 master the kernel moves
  fewer bytes (the figures are in ``benchmarks/RESULTS.md``).
  """
  return "reference" if name == "auto" and not half_params else name


__all__ = [
    "NAMES",
    "available",
    "Backend",
    "for_cuda",
    "fused_update",
    "register",
    "resolve",
    "tree_backend",
    "tree_grad_stats",
    "tree_update",
]
