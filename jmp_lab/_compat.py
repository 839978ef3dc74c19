"""Where jax versions differ: every difference jmp_lab meets, in one place.

jmp_lab supports jax 0.10.2 (the last release for Python 3.11) through the
newest release (0.12 at the time of writing); CI tests both ends
(``.ci/run``'s two lanes). Each helper below names the versions on each side
of the difference it hides, and tells the versions apart by what the
installed jax has (a parameter, an attribute), not by its version number, so
a release in between works as the side it resembles. No module of jmp_lab
outside this one asks which jax it runs on (the kernels ask only whether a
Pallas backend imports: ``jmp_lab.kernels.platform.importable``).

This module is a leaf: it imports jax only, so the kernels (the bottom of
jmp_lab's import graph) can use it too.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Sequence

import jax

#: The installed jax's version string, for messages and for matching the
#: CUDA plugin built for it (the one place jmp_lab reads it).
JAX_VERSION: str = jax.__version__


# ---------------------------------------------------------------------------
# Jaxprs (read by the precision interpreter, jmp_lab/_src/precision/).
# ---------------------------------------------------------------------------


def jaxpr_inputs(jaxpr: Any, consts: Sequence[Any]) -> tuple[list, list]:
  """``(constvars, invars)`` of ``jaxpr`` traced with ``consts``.

  jax <= 0.11 keeps a jaxpr's constant inputs apart (``jaxpr.constvars``);
  jax 0.12 merges ``ClosedJaxpr`` into ``Jaxpr``, and a jaxpr traced by
  ``trace_to_jaxpr_dynamic`` lists its constant inputs first among
  ``all_invars`` while its ``constvars`` (the inputs with values attached)
  is empty. Reading ``constvars`` and ``invars`` there binds the constants
  to the wrong variables (a ``KeyError`` on a ``Var`` later).
  """
  everything = getattr(jaxpr, "all_invars", None)
  if everything is None:  # jax <= 0.11
    return list(jaxpr.constvars), list(jaxpr.invars)
  return list(everything[:len(consts)]), list(everything[len(consts):])


def scan_counts(params: dict) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation.

  jax <= 0.11 names both in the equation's params; jax 0.12 gives a flat
  tree of the inputs instead, ``ft_in``, whose three parts are the consts,
  the carry and the scanned inputs.
  """
  if "num_consts" in params:  # jax <= 0.11
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def custom_vjp_cotangents(bwd_output: Any, count: int) -> list:
  """The flat input cotangents a ``custom_vjp_call`` equation's ``bwd``
  (``params["bwd"].call_wrapped``) returned.

  jax <= 0.11 returns the list of cotangents; jax 0.12, which added
  ``jax.custom_vjp.defvjp_with_logs``, returns a pair ``(cotangents,
  logs)``. Read as a list there, the pair is two non-arrays, and every
  cotangent would be taken for a zero: gradients silently zero. So what
  comes back is checked: ``count`` cotangents, each an array, a symbolic
  zero or None, or a ``RuntimeError`` says that this jax hands back
  something else (rather than a wrong gradient).
  """
  if hasattr(jax.custom_vjp, "defvjp_with_logs"):  # jax >= 0.12
    cotangents, _ = bwd_output
  else:
    cotangents = bwd_output
  cotangents = list(cotangents)
  if len(cotangents) != count or not all(map(_is_cotangent, cotangents)):
    raise RuntimeError(
        f"jmp_lab cannot read a custom_vjp backward rule's output on jax "
        f"{JAX_VERSION}: expected {count} cotangents (arrays, symbolic "
        f"zeros or None), got "
        f"{[type(c).__name__ for c in cotangents]}; please report it")
  return cotangents


def _is_cotangent(value: Any) -> bool:
  return value is None or (hasattr(value, "shape") and hasattr(
      value, "dtype")) or type(value).__name__ in ("Zero", "SymbolicZero")


# ---------------------------------------------------------------------------
# Pallas.
# ---------------------------------------------------------------------------


def mosaic_load(plgpu: Any, ref: Any, layout: Any) -> Any:
  """A whole Mosaic GPU ref into registers in ``layout``.

  jax 0.10 requires ``plgpu.load``'s index (``()`` for a whole ref); jax
  0.11 deprecates it (the "jax-pallas-mgpu-load-idx" warning) and gives it a
  default.
  """
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout, optimized=False)
  return plgpu.load(ref, layout=layout, optimized=False)


@contextlib.contextmanager
def without_persistent_cache():
  """A context in which jax writes nothing to its persistent compilation
  cache. An executable compiled for a GPU without one (an abstract topology)
  would be written there but cannot be read back ("PjRtCompiler must be
  constructed with a Client"), so each later compile would warn and compile
  anyway. jax decides once per process whether the cache is on, so turning
  ``jax_enable_compilation_cache`` off here would either do nothing or keep
  it off for the rest of the process; the minimum compile time to cache is
  read at every write instead. jax 0.10 to 0.12 keep it as a context manager
  under ``jax._src.config`` only."""
  from jax._src import config as jax_config
  with jax_config.persistent_cache_min_compile_time_secs(float("inf")):
    yield


def mosaic_tiling(tiles: Sequence[tuple[int, ...]]) -> Any:
  """A Mosaic GPU ``Tiling`` for ``plgpu.Layout.TILED`` (jax 0.10 to 0.12
  keep it in ``jax.experimental.mosaic.gpu.fragmented_array`` only)."""
  from jax.experimental.mosaic.gpu import fragmented_array  # GPU extra
  return fragmented_array.Tiling(tuple(tiles))


def mosaic_interpret_params() -> Any:
  """Parameters that run a ``plgpu.kernel`` under Pallas' Mosaic GPU
  interpreter on the CPU. jax 0.12 exports ``plgpu.InterpretGPUParams``;
  jax 0.10 has the same class under ``jax._src`` only."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret
    params = interpret.InterpretGPUParams
  return params()


def lowering_for(mesh: Any):
  """A context in which a computation for ``mesh``'s GPUs is traced and
  lowered as for them, on a machine without a GPU.

  Pallas' Triton lowering asks which GPU it compiles for. jax 0.10 reads the
  target from the compile itself; jax 0.12 reads the device kind of the
  abstract mesh in context (``jax.sharding.use_abstract_mesh``) and, with no
  GPU present and none in context, refuses ("No supported GPU devices found,
  please specify an abstract GPU device using AbstractDevice"). A mesh built
  from a GPU topology carries its device kind in ``mesh.abstract_mesh``, so
  tracing and lowering under it names the target on every version. (Both:
  each equation keeps the abstract mesh it was traced under, and lowering a
  nested ``jit`` restores it.)
  """
  abstract = (mesh if isinstance(mesh, jax.sharding.AbstractMesh)
              else getattr(mesh, "abstract_mesh", None))
  device = getattr(abstract, "abstract_device", None)
  use = getattr(jax.sharding, "use_abstract_mesh", None)
  if device is None or use is None or not jax.sharding.get_abstract_mesh().empty:
    # No device to name, or the caller's own mesh is in context (jax.set_mesh
    # on the target's mesh): left as it is.
    return contextlib.nullcontext()
  # A mesh of no axes that names the device: the code traced sees no mesh
  # (Flax's logical constraints, shardings: as without the context), and
  # the Triton lowering finds its GPU.
  return use(jax.sharding.AbstractMesh((), (), abstract_device=device))


def abstract_gpu(device_kind: str = "NVIDIA H100 80GB HBM3",
                 cores: int = 132) -> Any:
  """An abstract mesh (of no axes) on a GPU of ``device_kind``, for
  :func:`lowering_for` where no CUDA plugin builds a real topology (a
  lowering for CUDA alone, ``lower(lowering_platforms=("cuda",))``)."""
  device = jax.sharding.AbstractDevice(device_kind=device_kind,
                                       num_cores=cores, platform="gpu")
  return jax.sharding.AbstractMesh((), (), abstract_device=device)


__all__ = [
    "JAX_VERSION",
    "abstract_gpu",
    "custom_vjp_cotangents",
    "jaxpr_inputs",
    "lowering_for",
    "mosaic_load",
    "scan_counts",
    "without_call_site",
]


# ---------------------------------------------------------------------------
# Source locations.
# ---------------------------------------------------------------------------


def _traceback_of_no_call_site() -> Any:
  """A traceback holding no caller's frames: taken in a thread of its own,
  so only the thread's start and this function are on its stack."""
  import threading  # pylint: disable=import-outside-toplevel
  from jax._src import source_info_util  # pylint: disable=import-outside-toplevel
  taken = []
  thread = threading.Thread(
      target=lambda: taken.append(source_info_util.current().traceback))
  thread.start()
  thread.join()
  return taken[0]


_NO_CALL_SITE: list = []


@contextlib.contextmanager
def without_call_site():
  """Traces what it wraps as if from no call site: its ops carry one
  traceback, the same at every call.

  A Pallas kernel's lowered code carries the source locations of the ops
  traced into it, with the whole Python stack of the call. Two calls of one
  kernel on one input from two places (Flax's attention projects the same
  input for the query, the key and the value) are then two different
  kernels to XLA, which merges identical ones only. Traced under this, they
  are identical and XLA runs one. The name stack (``jax.named_scope``) is
  kept. jax 0.10 to 0.12 keep ``user_context`` under ``jax._src`` only; a
  jax without it traces as usual.
  """
  try:
    from jax._src import source_info_util  # pylint: disable=import-outside-toplevel
    context = source_info_util.user_context
    name_stack = source_info_util.current_name_stack()
  except (ImportError, AttributeError):
    yield
    return
  if not _NO_CALL_SITE:
    _NO_CALL_SITE.append(_traceback_of_no_call_site())
  with context(_NO_CALL_SITE[0], name_stack=name_stack):
    yield


def named_sharding(sharding: Any, mesh: Any, ndim: int) -> Any:
  """``sharding`` (a ``GSPMDSharding`` that ``custom_partitioning`` hands
  over undecoded, ``decode_shardings=False``) as a ``NamedSharding`` over
  ``mesh``, as jax decodes it itself; None where ``mesh``'s axes cannot
  express it: XLA splits a dimension by a factor no axis has (a count of
  blocks smaller than the devices, split 2 ways of 4), and jax's own
  decoding raises there, inside XLA's compile: ``IndivisibleError`` on a
  1-D mesh, ``KeyError`` from its search for the factor among a 2-D
  mesh's axes (6 tiles split 2 ways on a (2, 4) mesh)."""
  # The decoding jax itself runs, and the error it raises where it cannot.
  from jax._src import sharding as jax_sharding, sharding_impls
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  hlo = getattr(sharding, "_hlo_sharding", None)
  if hlo is None or mesh is None or getattr(mesh, "empty", True):
    return None
  try:
    spec = sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
  except (jax_sharding.IndivisibleError, KeyError):
    return None
  spec = tuple(spec) + (None,) * (ndim - len(spec))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty
  outside): jax 0.10's ``manual_axis_type.varying``, earlier jaxes'
  ``vma``."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))
