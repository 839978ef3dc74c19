"""The step as compiled for an H100 or H200, on a machine without a GPU.

XLA's GPU compiler ships in the CUDA plugin wheel and runs, all the way
through ptxas, with nothing but a target description: no device, no driver.
:func:`compiled_report` compiles any jittable function (a whole train step)
for a named target and device count that way and reads the optimized module:

* memory: argument, output, alias and temporary bytes;
* bytes per step: XLA's cost model plus the operand and result bytes of the
  custom calls it cannot see into (cuBLAS GEMMs, Pallas kernels), and, as a
  second model, the bytes crossing every kernel's boundary;
* kernels launched (``while`` bodies counted by their known trip count);
* every GEMM with its operand and result dtypes (cuBLAS, Triton, fused dots);
* every collective with its kind and dtype;
* the Pallas kernels, with ptxas' register and spill counts;
* a roofline lower bound on the step time -- a model, not a measurement.

It is the compiled counterpart of :func:`jmp_lab.diagnostics.audit_step`: on a
laptop it tells whether a step runs its matmuls on tensor cores in half
precision on an H100, how much memory it needs and what it reduces in fp32.

Requirements: the CUDA plugin of the installed jax version and ptxas
(``pip install "jmp_lab[gpu-compile]"``), and ``JAX_PLATFORMS=cpu`` set before
jax starts on a machine without a GPU.

Example (skipped by doctest: it needs the plugin and JAX_PLATFORMS=cpu)::

  >>> report = compiled_report(train_step, state, batch)  # doctest: +SKIP
  >>> print(report)                                       # doctest: +SKIP
  >>> report.fp32_gemms                                   # doctest: +SKIP
  []

README.md shows a real report of the GPT-2-small step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import importlib.metadata
import importlib.resources
import math
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Callable, Optional, Sequence, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jmp_lab.diagnostics import hlo
from jmp_lab.diagnostics.memory import compiled_memory
from jmp_lab.kernels import linear_cross_entropy as loss_kernels

# --------------------------------------------------------------------------
# Targets.
# --------------------------------------------------------------------------

# Dense tensor-core peaks from NVIDIA's H100 SXM / H200 data sheets (FLOP/s);
# "fp32" is the non-tensor-core rate. Used only for the roofline model.
_HOPPER_PEAKS = {"fp8": 1979e12, "16-bit": 989.4e12, "tf32": 494.7e12,
                 "fp32": 66.9e12, "fp64": 66.9e12}
_TARGET_FILES = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU to compile for: XLA's ``GpuTargetConfigProto`` text and its peaks.

  Attributes:
    name: ``"h100"``, ``"h200"`` or ``"custom"``.
    config: the target description (protobuf text).
    memory_bandwidth: bytes/s, from the description.
    peak_flops: dense FLOP/s by math kind (fp8, 16-bit, tf32, fp32).
  """

  name: str
  config: str = dataclasses.field(repr=False)
  memory_bandwidth: float
  peak_flops: dict[str, float] = dataclasses.field(repr=False)


def gpu_target(target: Union[str, GpuTarget]) -> GpuTarget:
  """``"h100"``, ``"h200"`` or a ``GpuTargetConfigProto`` text, as a target.

  Example::

    >>> gpu_target("h100").memory_bandwidth
    3352320000000.0
  """
  if isinstance(target, GpuTarget):
    return target
  if not isinstance(target, str):
    raise TypeError(f"target must be 'h100', 'h200' or a GpuTargetConfigProto "
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
  return GpuTarget(name, config,
                   float(bandwidth.group(1)) if bandwidth else math.nan,
                   dict(_HOPPER_PEAKS))


# --------------------------------------------------------------------------
# Compiling without a device.
# --------------------------------------------------------------------------

_INSTALL_HINT = (
    "compiling for a GPU without one needs the CUDA plugin of the installed "
    "jax version and ptxas: pip install \"jmp_lab[gpu-compile]\" (that is "
    f"jax[cuda12-local]=={jax.__version__} and nvidia-cuda-nvcc-cu12), or "
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
    if version == jax.__version__:
      return name, version
  if not found:
    raise RuntimeError(_INSTALL_HINT)
  listed = ", ".join(f"{n} {v}" for n, v in found.items())
  raise RuntimeError(f"{listed} does not match jax {jax.__version__}; "
                     f"{_INSTALL_HINT}")


def _check_plugin() -> None:
  cuda_plugin()


def gpu_mesh(target: Union[str, GpuTarget] = "h100", devices: int = 1,
             axis_name: str = "data") -> jax.sharding.Mesh:
  """A mesh of ``devices`` GPUs of ``target`` to compile for (no GPU needed).

  The same arguments give the same mesh, so a step built on it (a
  ``shard_map``, explicit shardings) compiles with :func:`compile_for_gpu`.
  """
  if not (isinstance(devices, int) and devices >= 1):
    raise ValueError(f"devices must be an int >= 1, got {devices!r}")
  _check_plugin()
  target = gpu_target(target)
  return _gpu_mesh(target.name, target.config, devices, axis_name)


@functools.lru_cache(maxsize=None)
def _gpu_mesh(name: str, config: str, devices: int,
              axis_name: str) -> jax.sharding.Mesh:
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", topology=f"1x1x{devices}", target_config=config)
  except (NotImplementedError, RuntimeError) as e:
    raise RuntimeError(
        f"could not describe {devices} x {name} to XLA ({e}); on a "
        f"machine without a GPU set JAX_PLATFORMS=cpu before jax starts") from e
  return topologies.make_mesh(topology, (devices,), (axis_name,))


def _abstract(args: Any, mesh, in_specs: Any) -> Any:
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
def _mosaic_dumps(directory: str):
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
                    dump_to: Optional[str] = None):
  """``fn`` compiled for ``devices`` GPUs of ``target``, without a GPU.

  Args:
    fn: a function, or a ``jax.jit``-ed one (its donation is kept).
    *args: example arguments: arrays, ShapeDtypeStructs, or pytrees of them
      (a TrainState); only shapes and dtypes are used.
    target: ``"h100"``, ``"h200"``, a target text or a :class:`GpuTarget`.
    devices: GPUs in the mesh (its one axis is ``"data"``).
    in_specs: a prefix tree of ``PartitionSpec`` s for ``args`` (default:
      replicated), e.g. ``(P(), P("data"))`` for a data-parallel step.
    donate_argnums: for a plain ``fn``, the arguments to donate.
    triton_gemm: let XLA emit GEMMs as Triton fusions. Without a device there
      is no autotuning, so the default sends them to cuBLAS, as they mostly
      go on a real H100.
    fail_on_spill: make a register spill in XLA's kernels a compile error.
    dump_to: a folder for XLA's and Mosaic's dumps (PTX, ptxas logs).
  """
  mesh = gpu_mesh(target, devices)
  jitted = fn if hasattr(fn, "trace") else jax.jit(
      fn, donate_argnums=donate_argnums)
  options = {"xla_gpu_enable_triton_gemm": bool(triton_gemm),
             # A production build's LLVM level, whatever XLA_FLAGS say (the
             # test suite lowers it for its CPU programs).
             "xla_backend_optimization_level": 3,
             "xla_gpu_fail_ptx_compilation_on_register_spilling":
                 bool(fail_on_spill)}
  if dump_to:
    options["xla_dump_to"] = dump_to
  specs = _abstract(args, mesh, in_specs)
  # Mosaic GPU compiles its kernels inside XLA's compile, so the dump
  # variables must hold for both steps.
  with _mosaic_dumps(dump_to) if dump_to else contextlib.nullcontext():
    lowered = jitted.trace(*specs).lower()
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:  # pylint: disable=broad-except  (XLA's own type)
      if "register spilling" not in str(e):
        raise
  raise RuntimeError(
      f"compiled for {target if isinstance(target, str) else target.name}, "
      f"{_spilling_kernels(lowered, options)}, which compile_for_gpu and "
      f"compiled_report refuse by default (a spill "
      f"costs local-memory traffic on every launch); pass "
      f"fail_on_spill=False to compile and report it anyway") from None


def _spilling_kernels(lowered, options) -> str:
  """Which of XLA's kernels spill: compiled again with spills allowed, and
  the PTX read back through ``ptxas -v``."""
  with tempfile.TemporaryDirectory(prefix="jmp_lab_spills_") as dump_dir:
    try:
      lowered.compile(compiler_options={
          **options, "xla_gpu_fail_ptx_compilation_on_register_spilling":
              False, "xla_dump_to": dump_dir})
    except Exception:  # pylint: disable=broad-except
      return "some of XLA's kernels spill registers"
    spilling = sorted(name for name, (_, spill) in _register_usage(
        dump_dir, None).items() if spill)
  if not spilling:
    return "some of XLA's kernels spill registers"
  names = ", ".join(spilling[:5]) + (f" and {len(spilling) - 5} more"
                                     if len(spilling) > 5 else "")
  return (f"XLA's kernels {names} spill registers" if len(spilling) > 1
          else f"XLA's kernel {names} spills registers")


# --------------------------------------------------------------------------
# What the compiled module does.
# --------------------------------------------------------------------------

_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
              "after-all", "opt-barrier", "partition-id", "replica-id",
              "call", "while", "conditional", "add-dependency", "domain"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast", "ragged-all-to-all"}
_PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class GemmRecord:
  """One GEMM (or convolution) of the compiled module."""

  kind: str                 # "cublas", "triton", "fused dot", "cudnn conv"
                            # or "pallas" (jmp_lab's loss kernels)
  lhs: hlo.Array
  rhs: hlo.Array
  out: hlo.Array
  precision: str            # XLA's operand precision, e.g. "DEFAULT"
  flops: float
  times: int                # launches per step (while trip counts)

  @property
  def math(self) -> str:
    """The tensor-core math it runs in: fp8, 16-bit, tf32, fp32 or fp64."""
    dtypes = {self.lhs.dtype, self.rhs.dtype}
    if all(d.startswith("f8") for d in dtypes):
      return "fp8"
    if dtypes <= {"bf16", "f16"}:
      return "16-bit"
    if "f64" in dtypes:
      return "fp64"
    return "fp32" if self.precision.upper() == "HIGHEST" else "tf32"

  @property
  def operands(self) -> str:
    return f"{self.lhs.dtype} x {self.rhs.dtype} -> {self.out.dtype}"


@dataclasses.dataclass(frozen=True)
class KernelRecord:
  """One kernel launch site: what it is, where it came from, what it moves."""

  name: str
  opcode: str
  op_name: str              # jax's name stack, e.g. "jit(step)/jmp_lab_update/..."
  io_bytes: int             # operands (the sliced part only) + results
  times: int


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
  kind: str
  dtypes: tuple[str, ...]
  bytes: int
  times: int


@dataclasses.dataclass(frozen=True)
class ThunkRecord:
  """One unit of work in XLA's GPU thunk sequence (what the runtime runs).

  Attributes:
    kind: XLA's thunk kind, e.g. ``"kCustomKernel"``, ``"kCublasLtMatmul"``.
    instruction: the HLO instruction it runs (its name in ``hlo_text``).
    graph: which command buffer holds it (XLA records a command buffer as a
      CUDA graph and launches the whole graph at once), or None where the
      host launches the thunk itself.
  """

  kind: str
  instruction: str
  graph: Optional[int]


@dataclasses.dataclass(frozen=True)
class PallasKernel:
  """A Pallas kernel in the module, with what ptxas says of it."""

  name: str
  backend: str              # "triton" or "mosaic"
  registers: Optional[int]  # per thread; None where no ptxas log was found
  spill_bytes: Optional[int]  # spill stores + loads


@dataclasses.dataclass
class CompiledReport:
  """What a step compiled for a GPU target does (see :func:`compiled_report`).

  Byte figures are per step. ``bytes_accessed`` is XLA's cost model plus the
  custom calls' operand and result bytes, plus ``loop_trip_bytes``: XLA's
  cost analysis counts a while loop's body once, whatever its trip count,
  so the kernels of a loop body are added for the other trips (their
  kernel-boundary bytes). ``kernel_io_bytes`` counts every
  kernel's operands (an operand read only through slices, as those slices)
  and results once (an upper bound where a kernel updates
  a buffer in place, a lower bound where it re-reads an operand).
  """

  target: GpuTarget
  devices: int
  memory: dict[str, int]
  cost_model_flops: Optional[float]
  cost_model_bytes: Optional[float]
  custom_call_bytes: int
  kernel_io_bytes: int
  kernels: int
  gemms: list[GemmRecord]
  collectives: list[CollectiveRecord]
  pallas_kernels: list[PallasKernel]
  kernel_records: list[KernelRecord] = dataclasses.field(repr=False)
  hlo_text: str = dataclasses.field(repr=False)
  thunks: list[ThunkRecord] = dataclasses.field(default_factory=list,
                                                repr=False)
  loop_trip_bytes: int = 0

  @property
  def bytes_accessed(self) -> Optional[float]:
    if self.cost_model_bytes is None:
      return None
    return self.cost_model_bytes + self.custom_call_bytes + self.loop_trip_bytes

  @property
  def gemm_flops(self) -> float:
    return sum(g.flops * g.times for g in self.gemms)

  @property
  def fp32_gemms(self) -> list[GemmRecord]:
    """GEMMs whose math is tf32 or fp32 (none, under a half policy)."""
    return [g for g in self.gemms if g.math in ("tf32", "fp32")]

  def gemm_flop_share(self, math_kind: str) -> float:
    total = self.gemm_flops
    return (sum(g.flops * g.times for g in self.gemms if g.math == math_kind)
            / total if total else 0.0)

  def scope(self, name: str) -> dict[str, int]:
    """Kernels and kernel-boundary bytes of the ops under a name scope.

    Wrap code in ``jax.named_scope(name)`` to find it here: the train step
    puts the optimizer update under ``"jmp_lab_update"``.
    """
    records = [k for k in self.kernel_records if name in k.op_name.split("/")]
    return {"kernels": sum(k.times for k in records),
            "io_bytes": sum(k.io_bytes * k.times for k in records),
            "host_launches": self.host_launches({k.name for k in records})}

  def host_launches(self, instructions: Optional[set[str]] = None) -> int:
    """Launches the host makes for ``instructions`` (default: every thunk
    that does work), each CUDA graph that holds any of them counted once.

    XLA records runs of kernels into command buffers (CUDA graphs); the
    kernels of a graph still run one after another on the GPU, but the host
    launches the graph once. Thunks inside loops count once here.
    """
    graphs, alone = set(), 0
    for thunk in self.thunks:
      if thunk.kind in _NO_WORK_THUNKS or (
          instructions is not None and thunk.instruction not in instructions):
        continue
      if thunk.graph is None:
        alone += 1
      else:
        graphs.add(thunk.graph)
    return alone + len(graphs)

  def pallas_summary(self) -> str:
    """The Pallas kernels, alike launches counted once, e.g.
    ``"jmp_lab_grad_stats x13 (triton, 25 registers, 0 B spilled)"``."""
    counts = collections.Counter(
        (k.name, k.backend, k.registers, k.spill_bytes)
        for k in self.pallas_kernels)
    return ", ".join(
        f"{name}{f' x{n}' if n > 1 else ''} ({backend}, "
        f"{'?' if regs is None else regs} registers, "
        f"{'?' if spill is None else spill} B spilled)"
        for (name, backend, regs, spill), n in counts.items()) or "none"

  def collective_summary(self) -> dict[str, int]:
    """Launches per step by ``"kind dtype"``, e.g. ``{"all-reduce f32": 3}``."""
    counts: dict[str, int] = collections.Counter()
    for c in self.collectives:
      counts[f"{c.kind} {'/'.join(c.dtypes)}"] += c.times
    return dict(counts)

  def collective_bytes(self) -> dict[str, int]:
    """Bytes moved per step by ``"kind dtype"`` (each launch's operands)."""
    moved: dict[str, int] = collections.Counter()
    for c in self.collectives:
      moved[f"{c.kind} {'/'.join(c.dtypes)}"] += c.bytes * c.times
    return dict(moved)

  def roofline_seconds(self) -> dict[str, float]:
    """A lower bound on the step time: a model, not a measurement.

    Memory time is ``bytes_accessed`` over the target's bandwidth; GEMM time
    is each GEMM's FLOPs over the data-sheet dense peak of its math. GEMMs
    are cuBLAS calls, XLA's dots and the products inside jmp_lab's Pallas
    loss kernels (``jmp_lab.kernels.linear_cross_entropy.gemm_flops``); the
    matmuls inside cuDNN's attention are not counted. Overlap
    would make the step faster than the sum, every other inefficiency slower.
    """
    moved = self.bytes_accessed or float(self.kernel_io_bytes)
    memory = moved / self.target.memory_bandwidth
    compute = sum(g.flops * g.times / self.target.peak_flops[g.math]
                  for g in self.gemms)
    return {"memory": memory, "gemm": compute, "total": memory + compute}

  def table(self) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    m = self.memory
    roof = self.roofline_seconds()
    lines = [
        f"compiled for {self.devices} x {self.target.name} (sm_90a, no device)",
        f"memory per device: arguments {gib(m.get('argument', 0))}, outputs "
        f"{gib(m.get('output', 0))}, aliased {gib(m.get('alias', 0))}, temp "
        f"{gib(m.get('temp', 0))}; peak {gib(m.get('peak', 0))}",
        f"bytes per step: {gb(self.bytes_accessed)} (cost model "
        f"{gb(self.cost_model_bytes)} + custom calls "
        f"{gb(self.custom_call_bytes)}"
        + (f" + loop trips {gb(self.loop_trip_bytes)}" if self.loop_trip_bytes
           else "") + f"); kernel boundaries {gb(self.kernel_io_bytes)}",
        f"kernels launched per step: {self.kernels}; host launches "
        f"{self.host_launches()} (kernels in a CUDA graph launched at once)",
        f"GEMM FLOPs: {self.gemm_flops / 1e9:.1f} GFLOP; roofline (model): "
        f"{roof['total'] * 1e3:.3f} ms = memory {roof['memory'] * 1e3:.3f} + "
        f"GEMM {roof['gemm'] * 1e3:.3f} ms",
        f"{'GEMMs':<12} {'operands':<26} {'math':<7} {'count':>6} "
        f"{'FLOP %':>7}"]
    groups: dict[tuple, list[GemmRecord]] = collections.defaultdict(list)
    for g in self.gemms:
      groups[(g.kind, g.operands, g.math)].append(g)
    total = self.gemm_flops or 1.0
    for (kind, operands, math_kind), records in sorted(
        groups.items(), key=lambda kv: -sum(g.flops * g.times for g in kv[1])):
      flops = sum(g.flops * g.times for g in records)
      lines.append(f"{kind:<12} {operands:<26} {math_kind:<7} "
                   f"{sum(g.times for g in records):>6} "
                   f"{100 * flops / total:>6.1f}%")
    collectives = self.collective_summary()
    lines.append("collectives: " + (", ".join(
        f"{k} x{v}" for k, v in sorted(collectives.items())) or "none"))
    lines.append("Pallas kernels: " + self.pallas_summary())
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _dot_flops(out: hlo.Array, lhs: hlo.Array, contracting: Sequence[int]
               ) -> float:
  k = math.prod(lhs.dims[d] for d in contracting if d < len(lhs.dims))
  return 2.0 * math.prod(out.dims) * k


def _dims(text: Optional[str]) -> list[int]:
  return [int(d) for d in re.findall(r"\d+", text or "")]


class _Walker:
  """Walks a parsed module from its entry, counting what runs how often."""

  def __init__(self, module: hlo.Module):
    self.module = module
    self.kernels = 0
    self.kernel_io_bytes = 0
    self.custom_call_bytes = 0
    self.loop_trip_bytes = 0  # what XLA's cost model misses in while loops
    self.gemms: list[GemmRecord] = []
    self.collectives: list[CollectiveRecord] = []
    self.pallas: list[tuple[str, str]] = []
    self.records: list[KernelRecord] = []

  def walk(self, computation: hlo.Computation, times: int) -> None:
    for inst in computation.instructions:
      self.visit(inst, times)

  def called(self, inst: hlo.Instruction, key: str) -> list[hlo.Computation]:
    value = inst.attribute(key) or ""
    names = re.findall(r"%?([\w.\-]+)", value)
    return [self.module.computations[n] for n in names
            if n in self.module.computations]

  def visit(self, inst: hlo.Instruction, times: int) -> None:
    op = inst.opcode
    if op == "while":
      trips = int(inst.backend_config().get("known_trip_count", {}).get("n", 1))
      for comp in self.called(inst, "body") + self.called(inst, "condition"):
        self.walk(comp, times * trips)
      return
    if op == "conditional":
      branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attributes)
      for name in re.findall(r"%?([\w.\-]+)", branches.group(1) if branches else ""):
        if name in self.module.computations:
          self.walk(self.module.computations[name], times)
      for key in ("true_computation", "false_computation"):
        for comp in self.called(inst, key):
          self.walk(comp, times)
      return
    if op == "call":
      for comp in self.called(inst, "to_apply"):
        self.walk(comp, times)
      return
    if op in _NO_KERNEL or op.endswith("-done"):
      return
    self.kernels += times
    io = self.io_bytes(inst)
    self.kernel_io_bytes += io * times
    if op != "custom-call":  # custom calls are counted with their trips
      self.loop_trip_bytes += io * (times - 1)
    self.records.append(KernelRecord(inst.name, op, inst.op_name, io, times))
    kind = op[:-len("-start")] if op.endswith("-start") else op
    if kind in _COLLECTIVES:
      # Every operand: XLA combines many arrays into one variadic collective.
      arrays = ([a for types in inst.operand_types for a in types]
                if inst.operand_types else inst.result)
      self.collectives.append(CollectiveRecord(
          kind, tuple(sorted({a.dtype for a in arrays})),
          sum(a.bytes for a in arrays), times))
    elif op == "custom-call":
      self.custom_call(inst, times)
    elif op == "fusion":
      self.fusion(inst, times)

  def io_bytes(self, inst: hlo.Instruction) -> int:
    """Operand and result bytes; a fusion operand read only through slices
    counts as the slices it reads, not the whole buffer."""
    if inst.opcode != "fusion":
      return inst.operand_bytes + inst.result_bytes
    comps = self.called(inst, "calls")
    if not comps:
      return inst.operand_bytes + inst.result_bytes
    users: dict[str, list[hlo.Instruction]] = collections.defaultdict(list)
    for i in comps[0].instructions:
      for operand in i.operands:
        users[operand].append(i)
    sliced = {}
    for i in comps[0].instructions:
      number = i.parameter_number if i.opcode == "parameter" else None
      uses = users.get(i.name, [])
      if number is not None and uses and all(
          u.opcode in ("slice", "dynamic-slice") for u in uses):
        sliced[number] = sum(u.result_bytes for u in uses)
    operands = sum(sliced.get(n, sum(a.bytes for a in arrays))
                   for n, arrays in enumerate(inst.operand_types))
    return operands + inst.result_bytes

  def custom_call(self, inst: hlo.Instruction, times: int) -> None:
    target = inst.attribute("custom_call_target") or ""
    result = inst.result
    if ("cublas" in target or "cudnn" in target) and len(result) > 1 and (
        result[-1].dtype in ("s8", "u8")):
      result = result[:-1]  # the workspace is scratch, not data
    self.custom_call_bytes += times * (
        inst.operand_bytes + sum(a.bytes for a in result))
    config = inst.backend_config()
    if "cublas" in target and len(inst.operand_types) >= 2:
      gemm = config.get("gemm_backend_config", {})
      dims = gemm.get("dot_dimension_numbers", {})
      precision = (gemm.get("precision_config", {})
                   .get("operand_precision", ["DEFAULT"]))
      lhs, rhs = inst.operand_types[0][0], inst.operand_types[1][0]
      self.gemms.append(GemmRecord(
          "cublas", lhs, rhs, result[0], str(max(precision, key=len)),
          _dot_flops(result[0], lhs, [int(d) for d in dims.get(
              "lhs_contracting_dimensions", [])]), times))
    elif "cudnn" in target and "conv" in target and len(inst.operand_types) >= 2:
      lhs, rhs = inst.operand_types[0][0], inst.operand_types[1][0]
      window = math.prod(rhs.dims) / max(1, rhs.dims[-1] if rhs.dims else 1)
      self.gemms.append(GemmRecord("cudnn conv", lhs, rhs, result[0], "DEFAULT",
                                   2.0 * math.prod(result[0].dims) * window,
                                   times))
    elif target.startswith(_PALLAS_TARGETS):
      name = config.get("name") or _pallas_name(inst)
      self.pallas.append((name, "mosaic" if "mosaic" in target else "triton"))
      if len(inst.operand_types) >= 2:
        lhs, rhs = inst.operand_types[0][0], inst.operand_types[1][0]
        flops = loss_kernels.gemm_flops(name, lhs.dims, rhs.dims)
        if flops:  # jmp_lab's own kernels that are GEMMs inside
          self.gemms.append(GemmRecord("pallas", lhs, rhs, result[0],
                                       "DEFAULT", flops, times))

  def fusion(self, inst: hlo.Instruction, times: int) -> None:
    kind = (inst.backend_config().get("fusion_backend_config", {})
            .get("kind", ""))
    label = ("triton" if "triton" in kind else
             "cublas" if "cublas" in kind else "fused dot")
    for comp in self.called(inst, "calls"):
      for dot in self.dots(comp):
        lhs, rhs = dot.operand_types[0][0], dot.operand_types[1][0]
        precision = re.search(r"operand_precision=\{(\w+)", dot.attributes)
        self.gemms.append(GemmRecord(
            label, lhs, rhs, dot.result[0],
            precision.group(1).upper() if precision else "DEFAULT",
            _dot_flops(dot.result[0], lhs,
                       _dims(dot.attribute("lhs_contracting_dims"))), times))

  def dots(self, computation: hlo.Computation) -> list[hlo.Instruction]:
    found = []
    for inst in computation.instructions:
      if inst.opcode == "dot" and len(inst.operand_types) >= 2 and all(
          inst.operand_types[:2]):
        found.append(inst)
      for comp in self.called(inst, "calls"):
        found.extend(self.dots(comp))
    return found


def _pallas_name(inst: hlo.Instruction) -> str:
  """The name given to ``pallas_call`` (the kernel's PTX entry for Triton)."""
  named = re.search(r'\bname = "([\w.\-]+)"', inst.attributes)
  if named:
    return named.group(1)
  op_name = re.search(r'op_name="([^"]*)/pallas_call"', inst.attributes)
  return op_name.group(1).rsplit("/", 1)[-1] if op_name else inst.name


def _cost_model(compiled) -> tuple[Optional[float], Optional[float]]:
  """XLA's cost analysis of the optimized module (flops, bytes accessed).

  ``compiled.cost_analysis()`` is None on the deviceless path; the analysis
  run through the CPU client's entry point gives the same figures.
  """
  try:
    from jax._src.lib import _jax  # no public equivalent
    module = compiled._executable.xla_extension_executable().hlo_modules()[0]
    cpu = jax.devices("cpu")[0].client
    cost = _jax.hlo_module_cost_analysis(cpu, module)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  except Exception:  # pylint: disable=broad-except  (private API moved)
    return None, None


# Thunks that hold or order others and launch nothing on the GPU themselves.
_NO_WORK_THUNKS = {"kCommandBuffer", "kSequential", "kWhile", "kConditional",
                   "kWaitForStreams"}
_THUNK_LINE = re.compile(r"^( *)(\d+): (k\w+)")
_THUNK_META = re.compile(
    r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)\s*}\s*'
    r'thunk_kind: "(k\w+)"')


def _thunks(dump_dir: str) -> list[ThunkRecord]:
  """The thunk sequence XLA dumped (after its thunk passes), with each
  thunk's HLO instruction and command buffer; empty if there is none."""
  # XLA writes the sequence after its passes (command buffers formed) only
  # where the passes changed it.
  sequences = (glob.glob(os.path.join(
      dump_dir, "*thunk_sequence_after_thunk_passes.txt"))
               or glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))
  metadata = glob.glob(os.path.join(dump_dir, "*thunk_metadata.txt"))
  if len(sequences) != 1 or len(metadata) != 1:
    return []
  with open(metadata[0]) as f:
    names = {int(i): name for name, i, _ in _THUNK_META.findall(f.read())}
  thunks, stack, graphs = [], [], 0   # stack: (indent, graph or None)
  with open(sequences[0]) as f:
    for line in f:
      match = _THUNK_LINE.match(line)
      if not match:
        continue
      indent, thunk_id, kind = len(match[1]), int(match[2]), match[3]
      while stack and stack[-1][0] >= indent:
        stack.pop()
      graph = stack[-1][1] if stack else None
      if kind == "kCommandBuffer":
        graphs += 1
        graph = graphs
      thunks.append(ThunkRecord(kind, names.get(thunk_id, ""), graph))
      stack.append((indent, graph))
  return thunks


def _ptxas() -> Optional[str]:
  try:
    import nvidia.cuda_nvcc  # the nvidia-cuda-nvcc-cu12 wheel
    for root in nvidia.cuda_nvcc.__path__:
      candidate = os.path.join(root, "bin", "ptxas")
      if os.path.exists(candidate):
        return candidate
  except ImportError:
    pass
  return shutil.which("ptxas")


_PTXAS_ENTRY = re.compile(
    r"Compiling entry function '([^']+)'.*?(\d+) bytes spill stores, "
    r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def _ptxas_usage(log: str) -> dict[str, tuple[int, int]]:
  """``{entry: (registers, spill bytes)}`` from a ``ptxas -v`` log."""
  return {name: (int(regs), int(stores) + int(loads))
          for name, stores, loads, regs in _PTXAS_ENTRY.findall(log)}


def _register_usage(dump_dir: str, names: Optional[Sequence[str]]
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
  for ptx in glob.glob(os.path.join(dump_dir, "*.ptx")):
    with open(ptx) as f:
      text = f.read()
    if names is not None and not any(f".entry {name}(" in text
                                     for name in names):
      continue
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    usage.update(_ptxas_usage(run.stdout + run.stderr))
  return usage


def compiled_report(fn: Callable[..., Any], *args, target="h100",
                    devices: int = 1, in_specs: Any = None,
                    donate_argnums: Union[int, Sequence[int]] = (),
                    triton_gemm: bool = False, fail_on_spill: bool = True
                    ) -> CompiledReport:
  """Compiles ``fn(*args)`` for a GPU target without a GPU and reports on it.

  Arguments are those of :func:`compile_for_gpu`. ``print(report)`` shows a
  table; the fields hold every figure (see :class:`CompiledReport`).

  Raises:
    RuntimeError: without the CUDA plugin of this jax version, or when jax
      started without ``JAX_PLATFORMS=cpu`` on a machine without a GPU.
  """
  target = gpu_target(target)
  with tempfile.TemporaryDirectory(prefix="jmp_lab_compiled_") as dump_dir:
    compiled = compile_for_gpu(
        fn, *args, target=target, devices=devices, in_specs=in_specs,
        donate_argnums=donate_argnums, triton_gemm=triton_gemm,
        fail_on_spill=fail_on_spill, dump_to=dump_dir)
    text = compiled.as_text()
    walker = _Walker(hlo.parse_module(text))
    walker.walk(walker.module.entry, 1)
    usage = (_register_usage(dump_dir, [n for n, _ in walker.pallas])
             if walker.pallas else {})
    thunks = _thunks(dump_dir)
  pallas = []
  mosaic_logs = sorted(name for name in usage if name.endswith("_kernel"))
  for name, backend in walker.pallas:
    found = usage.get(name)
    if found is None and backend == "mosaic" and mosaic_logs:
      found = usage[mosaic_logs.pop(0)]
    pallas.append(PallasKernel(name, backend, *(found or (None, None))))
  flops, cost_bytes = _cost_model(compiled)
  return CompiledReport(
      target=target, devices=devices, memory=compiled_memory(compiled),
      cost_model_flops=flops, cost_model_bytes=cost_bytes,
      custom_call_bytes=walker.custom_call_bytes,
      kernel_io_bytes=walker.kernel_io_bytes, kernels=walker.kernels,
      gemms=walker.gemms, collectives=walker.collectives,
      pallas_kernels=pallas, kernel_records=walker.records, hlo_text=text,
      thunks=thunks, loop_trip_bytes=walker.loop_trip_bytes)


__all__ = ["CollectiveRecord", "CompiledReport", "GemmRecord", "GpuTarget",
           "KernelRecord", "PallasKernel", "ThunkRecord", "compile_for_gpu", "compiled_report", "gpu_mesh",
           "gpu_target"]
