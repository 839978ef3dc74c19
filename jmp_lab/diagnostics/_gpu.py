"""Compiling for an H100 or H200 without one: targets, the CUDA plugin, the
device mesh, the compile itself, and ptxas' register counts (spills).
:mod:`jmp_lab.diagnostics.compiled` reads what it compiles."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib.metadata
import importlib.resources
import math
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jmp_lab import _compat as compat

# --------------------------------------------------------------------------
# Targets.
# --------------------------------------------------------------------------

# Dense tensor-core peaks from NVIDIA's H100 SXM / H200 data sheets (FLOP/s);
# "fp32" is the non-tensor-core rate. Used only for the roofline model.
HOPPER_PEAKS = {"fp8": 1979e12, "16-bit": 989.4e12, "tf32": 494.7e12,
                 "fp32": 66.9e12, "fp64": 66.9e12}
# Dense tensor-core peaks of one B200 (SXM), from NVIDIA's HGX B200 data
# sheet (its 8-GPU sparse figures halved for dense and divided by 8): MXFP8
# runs at the fp8 rate, NVFP4 at the fp4 rate.
BLACKWELL_PEAKS = {"fp4": 9e15, "fp8": 4.5e15, "16-bit": 2.25e15,
                   "tf32": 1.1e15, "fp32": 75e12, "fp64": 37e12}
_TARGET_FILES = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb",
                 "b200": "b200.txtpb"}
_TARGET_PEAKS = {"h100": HOPPER_PEAKS, "h200": HOPPER_PEAKS,
                 "b200": BLACKWELL_PEAKS}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU to compile for: XLA's ``GpuTargetConfigProto`` text and its peaks.

  Attributes:
    name: ``"h100"``, ``"h200"``, ``"b200"`` or ``"custom"``.
    config: the target description (protobuf text).
    memory_bandwidth: bytes/s, from the description.
    peak_flops: dense FLOP/s by math kind (fp4 on Blackwell, fp8, 16-bit,
      tf32, fp32).
  """

  name: str
  config: str = dataclasses.field(repr=False)
  memory_bandwidth: float
  peak_flops: dict[str, float] = dataclasses.field(repr=False)


def gpu_target(target: Union[str, GpuTarget]) -> GpuTarget:
  """``"h100"``, ``"h200"``, ``"b200"`` or a ``GpuTargetConfigProto`` text,
  as a target. The B200's is XLA's own spec with cuDNN 9.10 as its cuDNN
  version (XLA lowers block-scaled dots to cuDNN only from 9.10 on).

  Example::

    >>> gpu_target("h100").memory_bandwidth
    3352320000000.0
  """
  if isinstance(target, GpuTarget):
    return target
  if not isinstance(target, str):
    raise TypeError(f"target must be 'h100', 'h200', 'b200' or a "
                    f"GpuTargetConfigProto "
                    f"text, got {type(target).__name__} {target!r}")
  name = target.strip().lower()
  if name in _TARGET_FILES:
    config = (importlib.resources.files("jmp_lab.diagnostics") / "gpu_targets"
              / _TARGET_FILES[name]).read_text()
  elif "gpu_device_info" in target:
    name, config = "custom", target
  else:
    raise ValueError(f"unknown target {target!r}; accepted: "
                     f"{', '.join(_TARGET_FILES)} or a GpuTargetConfigProto "
                     f"text (with gpu_device_info)")
  bandwidth = re.search(r"memory_bandwidth:\s*(\d+)", config)
  blackwell = re.search(r"cuda_compute_capability\s*{\s*major:\s*10", config)
  peaks = _TARGET_PEAKS.get(name, BLACKWELL_PEAKS if blackwell
                            else HOPPER_PEAKS)
  return GpuTarget(name, config,
                   float(bandwidth.group(1)) if bandwidth else math.nan,
                   dict(peaks))


# --------------------------------------------------------------------------
# Compiling without a device.
# --------------------------------------------------------------------------

_INSTALL_HINT = (
    "compiling for a GPU without one needs the CUDA plugin of the installed "
    "jax version and ptxas: from jmp_lab's clone, pip install -e "
    "\".[gpu-compile]\" (the jmp_lab[gpu-compile] extra: "
    f"jax[cuda12-local]=={compat.JAX_VERSION} and nvidia-cuda-nvcc-cu12), or "
    "the CUDA 13 plugin a GPU machine's jax brings")
# The CUDA plugins jax ships: CUDA 12 (what the gpu-compile extra installs)
# and CUDA 13 (jax 0.11's GPU machines).
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def cuda_plugin() -> tuple[str, str]:
  """``(package, version)`` of the installed CUDA plugin that matches jax.

  Raises:
    RuntimeError: when no CUDA plugin is installed, or none matches jax's
      version (the message says which were found and what to install).
  """
  found = {}
  for name in CUDA_PLUGINS:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  for name, version in found.items():
    if version == compat.JAX_VERSION:
      return name, version
  if not found:
    raise RuntimeError(_INSTALL_HINT)
  listed = ", ".join(f"{n} {v}" for n, v in found.items())
  raise RuntimeError(f"{listed} does not match jax {compat.JAX_VERSION}; "
                     f"{_INSTALL_HINT}")


def check_plugin() -> None:
  cuda_plugin()


def gpu_mesh(target: Union[str, GpuTarget] = "h100", devices: int = 1,
             axis_name: str = "data", *,
             axes: Optional[Mapping[str, int]] = None) -> jax.sharding.Mesh:
  """A mesh of ``devices`` GPUs of ``target`` to compile for (no GPU needed).

  One axis, ``axis_name``, by default; ``axes`` (``{"fsdp": 4, "tensor":
  2}``) gives several, their sizes multiplying to ``devices``. The same
  arguments give the same mesh, so a step built on it (a ``shard_map``,
  explicit shardings) compiles with :func:`compile_for_gpu`.
  """
  if not (isinstance(devices, int) and devices >= 1):
    raise ValueError(f"devices must be an int >= 1, got {devices!r}")
  shape = _mesh_shape(devices, axis_name, axes)
  check_plugin()
  target = gpu_target(target)
  return _gpu_mesh(target.name, target.config, shape)


def _mesh_shape(devices: int, axis_name: str,
                axes: Optional[Mapping[str, int]]) -> tuple[tuple[str, int], ...]:
  if axes is None:
    return ((axis_name, devices),)
  shape = tuple(dict(axes).items())
  if not shape or not all(isinstance(n, str) and isinstance(s, int) and s >= 1
                          for n, s in shape):
    raise ValueError(f"axes must map axis names to sizes >= 1, got {axes!r}")
  if int(np.prod([s for _, s in shape])) != devices:
    raise ValueError(f"the sizes of axes={dict(shape)!r} multiply to "
                     f"{int(np.prod([s for _, s in shape]))}, not "
                     f"devices={devices}")
  return shape


@functools.lru_cache(maxsize=None)
def _gpu_mesh(name: str, config: str,
              shape: tuple[tuple[str, int], ...]) -> jax.sharding.Mesh:
  from jax.experimental import topologies
  devices = int(np.prod([s for _, s in shape]))
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", topology=f"1x1x{devices}", target_config=config)
  except (NotImplementedError, RuntimeError) as e:
    # Without a GPU the plugin registers only if its version check was off
    # when jax started: jmp_lab turns it off on import (_src/cuda_plugin.py),
    # too late if jax had already run something.
    raise RuntimeError(
        f"could not describe {devices} x {name} to XLA ({e}): the CUDA "
        f"plugin did not register when jax started. On a machine without a "
        f"GPU, import jmp_lab before jax's first computation, or set "
        f"JAX_PLATFORMS=cpu before jax starts") from e
  return topologies.make_mesh(topology, tuple(s for _, s in shape),
                              tuple(n for n, _ in shape))


def abstract_args(args: Any, mesh, in_specs: Any) -> Any:
  """``args`` as ShapeDtypeStructs sharded on ``mesh`` by ``in_specs``."""

  def leaf(x, spec):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                  sharding=NamedSharding(mesh, spec))
    return x

  if in_specs is None:
    return jax.tree_util.tree_map(lambda x: leaf(x, PartitionSpec()), args)
  is_spec = lambda s: isinstance(s, PartitionSpec) or s is None  # noqa: E731
  return jax.tree_util.tree_map(
      lambda spec, sub: jax.tree_util.tree_map(
          lambda x: leaf(x, spec or PartitionSpec()), sub),
      in_specs, args, is_leaf=is_spec)


@contextlib.contextmanager
def mosaic_dumps(directory: str):
  """Mosaic GPU writes its ptxas log where these variables say."""
  wanted = {"MOSAIC_GPU_DUMP_TO": directory, "MOSAIC_GPU_DUMP_PTXAS": "1"}
  saved = {k: os.environ.get(k) for k in wanted}
  os.environ.update(wanted)
  try:
    yield
  finally:
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


def compile_for_gpu(fn: Callable[..., Any], *args, target="h100",
                    devices: int = 1, in_specs: Any = None,
                    donate_argnums: Union[int, Sequence[int]] = (),
                    triton_gemm: bool = False, fail_on_spill: bool = True,
                    dump_to: Optional[str] = None,
                    axes: Optional[Mapping[str, int]] = None):
  """``fn`` compiled for ``devices`` GPUs of ``target``, without a GPU.

  XLA's fusion autotuner is off: with no device to time its candidates on,
  it would keep each fusion's default config after compiling them all (a
  third of jax 0.12's compile of GPT-2-small's step), so the program is the
  same.

  Args:
    fn: a function, or a ``jax.jit``-ed one (its donation is kept).
    *args: example arguments: arrays, ShapeDtypeStructs, or pytrees of them
      (a TrainState); only shapes and dtypes are used.
    target: ``"h100"``, ``"h200"``, ``"b200"``, a target text or a
      :class:`GpuTarget`.
    devices: GPUs in the mesh (its one axis is ``"data"``).
    axes: the mesh's axes and sizes instead (``{"fsdp": 4, "tensor": 2}``,
      see :func:`gpu_mesh`).
    in_specs: a prefix tree of ``PartitionSpec`` s for ``args`` (default:
      replicated), e.g. ``(P(), P("data"))`` for a data-parallel step.
    donate_argnums: for a plain ``fn``, the arguments to donate.
    triton_gemm: let XLA emit GEMMs as Triton fusions. Without a device there
      is no autotuning, so the default sends them to cuBLAS, as they mostly
      go on a real H100.
    fail_on_spill: make a register spill in XLA's kernels a compile error,
      a ``RuntimeError`` that names them. Compiling the same program again
      with ``fail_on_spill=False`` then returns the compile that named them,
      without compiling a third time.
    dump_to: a folder for XLA's and Mosaic's dumps (PTX, ptxas logs).
  """
  mesh = gpu_mesh(target, devices, axes=axes)
  jitted = fn if hasattr(fn, "trace") else jax.jit(
      fn, donate_argnums=donate_argnums)
  options = {"xla_gpu_enable_triton_gemm": bool(triton_gemm),
             # A production build's LLVM level, whatever XLA_FLAGS say (the
             # test suite lowers it for its CPU programs).
             "xla_backend_optimization_level": 3,
             # Nothing can be timed without a device, so XLA's fusion
             # autotuner keeps each fusion's default config; jax 0.12's XLA
             # still compiles every candidate first (its "config-assigner"
             # pass), a third of a GPT step's compile. Off, the defaults are
             # taken directly: the same kernels, bytes and memory. (GEMMs'
             # autotuning stays on: it sets cuBLAS's workspace.)
             _FUSION_AUTOTUNER_OPTION: False,
             _SPILL_OPTION: bool(fail_on_spill)}
  if dump_to:
    options.update(_dump_options(dump_to))
  specs = abstract_args(args, mesh, in_specs)
  # Mosaic GPU compiles its kernels inside XLA's compile, so the dump
  # variables must hold for both steps.
  # Pallas' Triton lowering asks which GPU it compiles for (jax 0.12), also
  # from inside XLA's compile (a custom_partitioning callback lowers its
  # kernels while XLA partitions the program).
  # Not through the persistent compilation cache: see
  # compat.without_persistent_cache.
  with (mosaic_dumps(dump_to) if dump_to else contextlib.nullcontext(),
        compat.lowering_for(mesh), compat.without_persistent_cache()):
    lowered = jitted.trace(*specs).lower()
    if not fail_on_spill and _REFUSED_FOR_SPILLS:
      retried = _take_refused(_program_key(lowered, mesh, options), dump_to)
      if retried is not None:
        return retried
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:  # pylint: disable=broad-except  (XLA's own type)
      if "register spilling" not in str(e):
        raise
    spilling = _name_spilling_kernels(lowered, mesh, options, dump_to)
  raise RuntimeError(
      f"compiled for {target if isinstance(target, str) else target.name}, "
      f"{spilling}, which compile_for_gpu and "
      f"compiled_report refuse by default (a spill "
      f"costs local-memory traffic on every launch); pass "
      f"fail_on_spill=False to compile and report it anyway") from None


# The last program compile_for_gpu refused for its spills, as compiled with
# spills allowed to name them (XLA's error names no kernel), and the folder
# of that compile's dumps. The retry that the error suggests,
# fail_on_spill=False, takes it instead of compiling the program a third
# time. One entry (one executable and its dumps on disk), held until that
# retry, the next refusal or the end of the process.
_REFUSED_FOR_SPILLS: dict[tuple, tuple[Any, Any]] = {}
_SPILL_OPTION = "xla_gpu_fail_ptx_compilation_on_register_spilling"
_FUSION_AUTOTUNER_OPTION = "xla_gpu_experimental_enable_fusion_autotuner"
_PTX_KEEPING_DIR = "cuda_keeping_ptx"
# Options that say where a compile's dumps go, not what it compiles.
_DUMP_OPTIONS = ("xla_dump_to", "xla_gpu_cuda_data_dir")


def _program_key(lowered, mesh, options) -> tuple:
  """What makes two compiles the same program: the module, the target and
  devices (the cached mesh), and XLA's options but the spill check and the
  dump folders."""
  text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
  return (text, mesh, tuple(sorted(
      (k, v) for k, v in options.items()
      if k != _SPILL_OPTION and k not in _DUMP_OPTIONS)))


def _copy_dumps(source: str, dump_to: str) -> None:
  # The dumps, not the ptxas wrapper that _dump_options puts beside them.
  shutil.copytree(source, dump_to, symlinks=True, dirs_exist_ok=True,
                  ignore=shutil.ignore_patterns(_PTX_KEEPING_DIR))


def _take_refused(key: tuple, dump_to: Optional[str]):
  """The refused program's compile for its retry (its dumps copied into
  ``dump_to``), or None if it is another program."""
  if key not in _REFUSED_FOR_SPILLS:
    return None
  compiled, dumps = _REFUSED_FOR_SPILLS.pop(key)
  if dump_to:
    _copy_dumps(dumps.name, dump_to)
  dumps.cleanup()
  return compiled


def _name_spilling_kernels(lowered, mesh, options,
                           dump_to: Optional[str]) -> str:
  """Which of XLA's kernels spill: compiled again with spills allowed, into
  a folder of its own (so that nothing else there is read as this
  program's), and the PTX read back through ``ptxas -v``. That compile and
  its dumps are kept for the retry (_REFUSED_FOR_SPILLS), and the dumps
  copied into ``dump_to`` when given."""
  unnamed = "some of XLA's kernels spill registers"
  for _, kept in _REFUSED_FOR_SPILLS.values():
    kept.cleanup()
  _REFUSED_FOR_SPILLS.clear()
  dumps = tempfile.TemporaryDirectory(prefix="jmp_lab_spills_")
  try:
    compiled = lowered.compile(compiler_options={
        **options, _SPILL_OPTION: False, **_dump_options(dumps.name)})
  except Exception:  # pylint: disable=broad-except
    dumps.cleanup()
    return unnamed
  spilling = sorted(name for name, (_, spill) in register_usage(
      dumps.name, None).items() if spill)
  if dump_to:
    _copy_dumps(dumps.name, dump_to)
  _REFUSED_FOR_SPILLS[_program_key(lowered, mesh, options)] = (compiled,
                                                               dumps)
  if not spilling:
    return unnamed
  names = ", ".join(spilling[:5]) + (f" and {len(spilling) - 5} more"
                                     if len(spilling) > 5 else "")
  return (f"XLA's kernels {names} spill registers" if len(spilling) > 1
          else f"XLA's kernel {names} spills registers")


def _dump_options(dump_dir: str) -> dict:
  """XLA's options that dump a compile into ``dump_dir``: its HLO, thunks
  and the PTX of every kernel ptxas compiles.

  XLA up to jax 0.10 writes each module's PTX there itself
  (``module_*.ptx``); the XLA of jax 0.12 no longer does. Both hand the PTX
  to the ``ptxas`` under ``xla_gpu_cuda_data_dir`` in a temporary file, so
  the compile is pointed at a copy of the CUDA directory whose ``ptxas``
  keeps a copy of each input in ``dump_dir`` and then runs the real one:
  one way to read the registers on every version.
  """
  options = {"xla_dump_to": dump_dir}
  data_dir = _ptx_keeping_cuda_dir(dump_dir)
  if data_dir is not None:
    options["xla_gpu_cuda_data_dir"] = data_dir
  return options


def _ptx_keeping_cuda_dir(dump_dir: str) -> Optional[str]:
  """A CUDA directory inside ``dump_dir`` mirroring the nvcc wheel's, whose
  ``bin/ptxas`` copies its PTX input into ``dump_dir`` before running the
  real ptxas (None without the wheel)."""
  real = _nvcc_root()
  if real is None:
    return None
  mirror = os.path.join(dump_dir, _PTX_KEEPING_DIR)
  os.makedirs(os.path.join(mirror, "bin"), exist_ok=True)
  for entry in os.listdir(real):
    if entry != "bin" and not os.path.exists(os.path.join(mirror, entry)):
      os.symlink(os.path.join(real, entry), os.path.join(mirror, entry))
  wrapper = os.path.join(mirror, "bin", "ptxas")
  with open(wrapper, "w") as f:
    f.write(_PTXAS_KEEPING_PTX.format(dump=shlex.quote(dump_dir),
                                      ptxas=shlex.quote(os.path.join(
                                          real, "bin", "ptxas"))))
  os.chmod(wrapper, 0o755)
  try:  # a dump folder on a noexec mount cannot hold it: XLA's own then
    subprocess.run([wrapper, "--version"], check=True, capture_output=True,
                   timeout=60)
  except (OSError, subprocess.SubprocessError):
    return None
  return mirror


# XLA calls `ptxas FILE -o OUT -arch=... [flags]`: a file argument that is
# PTX (it has a .version line) is kept as dump_dir/kept_<name>.ptx.
_PTXAS_KEEPING_PTX = """#!/bin/sh
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) if [ -f "$arg" ] && grep -q '^[.]version' "$arg" 2>/dev/null; then
         cp "$arg" {dump}/"kept_$(basename "$arg").ptx"
       fi ;;
  esac
done
exec {ptxas} "$@"
"""


def _nvcc_root() -> Optional[str]:
  """A CUDA directory with ``bin/ptxas`` and ``nvvm/``: the
  nvidia-cuda-nvcc-cu12 wheel's, else the toolkit whose ``ptxas`` is on the
  PATH (a GPU machine's)."""
  try:
    import nvidia.cuda_nvcc  # the nvidia-cuda-nvcc-cu12 wheel
    roots = list(nvidia.cuda_nvcc.__path__)
  except ImportError:
    roots = []
  on_path = shutil.which("ptxas")
  if on_path:
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(on_path))))
  for root in roots:
    if (os.path.exists(os.path.join(root, "bin", "ptxas"))
        and os.path.isdir(os.path.join(root, "nvvm"))):
      return root
  return None


def _ptxas() -> Optional[str]:
  root = _nvcc_root()
  if root is not None:
    return os.path.join(root, "bin", "ptxas")
  return shutil.which("ptxas")


_PTXAS_ENTRY = re.compile(
    r"Compiling entry function '([^']+)'.*?(\d+) bytes spill stores, "
    r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def _ptxas_usage(log: str) -> dict[str, tuple[int, int]]:
  """``{entry: (registers, spill bytes)}`` from a ``ptxas -v`` log."""
  return {name: (int(regs), int(stores) + int(loads))
          for name, stores, loads, regs in _PTXAS_ENTRY.findall(log)}


def register_usage(dump_dir: str, names: Optional[Sequence[str]]
                    ) -> dict[str, tuple[int, int]]:
  """Registers and spills of the named kernels (None: every kernel), from
  the dumps in ``dump_dir``.

  Mosaic GPU writes its own ptxas logs; XLA writes PTX, which ptxas compiles
  again here with ``-v`` (only the files that hold a wanted kernel).
  """
  usage: dict[str, tuple[int, int]] = {}
  for log in glob.glob(os.path.join(dump_dir, "*.ptxas")):
    with open(log) as f:
      usage.update(_ptxas_usage(f.read()))
  ptxas = _ptxas()
  if ptxas is None:
    return usage
  dumped = glob.glob(os.path.join(dump_dir, "*.ptx"))
  # XLA's own dumps where it writes them (jax 0.10); else the copies kept by
  # the ptxas wrapper (_dump_options): not both, each kernel once.
  ptx_files = [p for p in dumped if not os.path.basename(p).startswith(
      "kept_")] or dumped
  for ptx in ptx_files:
    with open(ptx) as f:
      text = f.read()
    if names is not None and not any(f".entry {name}(" in text
                                     for name in names):
      continue
    # The GPU the PTX was written for (sm_100a for a B200), not always the
    # H100's: ptxas refuses PTX for a newer GPU than -arch.
    target = re.search(r"^\.target\s+(sm_\w+)", text, re.M)
    arch = target.group(1) if target else "sm_90a"
    run = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx, "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    usage.update(_ptxas_usage(run.stdout + run.stderr))
  return usage
