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
(``pip install -e ".[gpu-compile]"`` from jmp_lab's clone). On a machine
without a GPU, import jmp_lab before jax's first computation (it keeps the
plugin quiet and registered there), or set ``JAX_PLATFORMS=cpu``.

Example (skipped by doctest: it needs the plugin)::

  >>> report = compiled_report(train_step, state, batch)  # doctest: +SKIP
  >>> print(report)                                       # doctest: +SKIP
  >>> report.fp32_gemms                                   # doctest: +SKIP
  []

README.md shows a real report of the GPT-2-small step.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax

from jmp_lab.diagnostics import hlo
from jmp_lab.diagnostics._gpu import (GpuTarget, compile_for_gpu, cuda_plugin,
                                      gpu_mesh, gpu_target, register_usage)
from jmp_lab.diagnostics.memory import compiled_memory
from jmp_lab.kernels import linear_cross_entropy as loss_kernels

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
  """One collective: its kind (``"all-gather"``, ...), its operands' dtypes
  and bytes, how many times a step runs it, and jax's name stack of the op
  that asked for it (``op_name``: which scope, e.g. the loss or
  ``jmp_lab_update``, a collective serves)."""

  kind: str
  dtypes: tuple[str, ...]
  bytes: int
  times: int
  op_name: str = ""


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


def _without_workspace(inst: hlo.Instruction) -> list:
  """A library call's results but its scratch workspace (cuBLAS and cuDNN
  return one as a last s8/u8 result)."""
  target = inst.attribute("custom_call_target") or ""
  result = inst.result
  if ("cublas" in target or "cudnn" in target) and len(result) > 1 and (
      result[-1].dtype in ("s8", "u8")):
    return result[:-1]
  return result


def _library_gemm(inst: hlo.Instruction, result: list,
                  times: int) -> Optional[GemmRecord]:
  """The GEMM a cuBLAS or cuDNN convolution custom call runs (None for any
  other call)."""
  target = inst.attribute("custom_call_target") or ""
  if len(inst.operand_types) < 2 or not all(inst.operand_types[:2]):
    return None
  lhs, rhs = inst.operand_types[0][0], inst.operand_types[1][0]
  if "cublas" in target:
    gemm = inst.backend_config().get("gemm_backend_config", {})
    dims = gemm.get("dot_dimension_numbers", {})
    precision = (gemm.get("precision_config", {})
                 .get("operand_precision", ["DEFAULT"]))
    return GemmRecord(
        "cublas", lhs, rhs, result[0], str(max(precision, key=len)),
        _dot_flops(result[0], lhs, [int(d) for d in dims.get(
            "lhs_contracting_dimensions", [])]), times)
  if "cudnn" in target and "conv" in target:
    window = math.prod(rhs.dims) / max(1, rhs.dims[-1] if rhs.dims else 1)
    return GemmRecord("cudnn conv", lhs, rhs, result[0], "DEFAULT",
                      2.0 * math.prod(result[0].dims) * window, times)
  return None


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
          sum(a.bytes for a in arrays), times, inst.op_name))
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
    result = _without_workspace(inst)
    self.custom_call_bytes += times * (
        inst.operand_bytes + sum(a.bytes for a in result))
    config = inst.backend_config()
    library_gemm = _library_gemm(inst, result, times)
    if library_gemm is not None:
      self.gemms.append(library_gemm)
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
      # jax 0.12's XLA puts a cuBLAS call that reads a dynamic slice (a
      # scanned layer's weight) inside a "dynamic slice fusion".
      for call in comp.instructions:
        if call.opcode == "custom-call":
          library_gemm = _library_gemm(call, _without_workspace(call), times)
          if library_gemm is not None:
            self.gemms.append(library_gemm)
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

  ``compiled.cost_analysis()`` answers where it can; it is None on the
  deviceless path (also on a GPU machine), where the analysis run through
  the CPU client's entry point gives the same figures.
  """
  try:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one entry per module (older jax)
      cost = cost[0] if cost else None
    if cost:
      return (float(cost.get("flops", 0.0)),
              float(cost.get("bytes accessed", 0.0)))
  except Exception:  # pylint: disable=broad-except  (no analysis here)
    pass
  try:
    from jax._src.lib import _jax  # no public equivalent
    module = compiled._executable.xla_extension_executable().hlo_modules()[0]
  except Exception:  # pylint: disable=broad-except  (private API moved)
    return None, None
  # Through the CPU client: the CUDA client's PJRT C API has no cost
  # analysis ("UNIMPLEMENTED"), so with JAX_PLATFORMS=cuda alone there is no
  # byte model; JAX_PLATFORMS=cuda,cpu keeps one (benchmarks/gpu_run.sh).
  try:
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client,
                                         module)
  except Exception:  # pylint: disable=broad-except  (no CPU client here)
    return None, None
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


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


def compiled_report(fn: Callable[..., Any], *args, target="h100",
                    devices: int = 1, in_specs: Any = None,
                    donate_argnums: Union[int, Sequence[int]] = (),
                    triton_gemm: bool = False, fail_on_spill: bool = True,
                    axes: Optional[Mapping[str, int]] = None
                    ) -> CompiledReport:
  """Compiles ``fn(*args)`` for a GPU target without a GPU and reports on it.

  Arguments are those of :func:`compile_for_gpu`. ``print(report)`` shows a
  table; the fields hold every figure (see :class:`CompiledReport`).

  Raises:
    RuntimeError: without the CUDA plugin of this jax version, or when jax
      started before jmp_lab was imported, without ``JAX_PLATFORMS=cpu``, on
      a machine without a GPU.
  """
  target = gpu_target(target)
  with tempfile.TemporaryDirectory(prefix="jmp_lab_compiled_") as dump_dir:
    compiled = compile_for_gpu(
        fn, *args, target=target, devices=devices, in_specs=in_specs,
        donate_argnums=donate_argnums, triton_gemm=triton_gemm,
        fail_on_spill=fail_on_spill, dump_to=dump_dir, axes=axes)
    text = compiled.as_text()
    walker = _Walker(hlo.parse_module(text))
    walker.walk(walker.module.entry, 1)
    usage = (register_usage(dump_dir, [n for n, _ in walker.pallas])
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
           "KernelRecord", "PallasKernel", "ThunkRecord", "compile_for_gpu",
           "compiled_report", "cuda_plugin", "gpu_mesh", "gpu_target"]
