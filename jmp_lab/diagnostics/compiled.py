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
* the step time in two roofline models (GEMMs' bytes added to their math,
  or hidden under it) -- models, not measurements.

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
import os
import re
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax

from jmp_lab.diagnostics import hlo
from jmp_lab.diagnostics._walk import (CollectiveRecord, GemmRecord,
                                       KernelRecord, PallasKernel,
                                       ThunkRecord, Walker)
from jmp_lab.diagnostics._gpu import (GpuTarget, compile_for_gpu, cuda_plugin,
                                      gpu_mesh, gpu_target, register_usage)
from jmp_lab.diagnostics.memory import compiled_memory

# --------------------------------------------------------------------------
# What the compiled module does.
# --------------------------------------------------------------------------

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

  @property
  def block_scaled_gemms(self) -> list[GemmRecord]:
    """Blackwell's block-scaled GEMMs (cuDNN's ``__cudnn$blockScaledDot``):
    MXFP8 (fp8 math) and NVFP4 (fp4 math)."""
    return [g for g in self.gemms if g.block_scaled is not None]

  def block_scaled_flop_share(self) -> float:
    """The share of the GEMM FLOPs that block-scaled GEMMs carry."""
    total = self.gemm_flops
    return (sum(g.flops * g.times for g in self.block_scaled_gemms) / total
            if total else 0.0)

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
    """The step time in two roofline models: models, not measurements.

    ``"memory"`` is ``bytes_accessed`` over the target's bandwidth;
    ``"gemm"`` is each GEMM's FLOPs over the data-sheet dense peak of its
    math. GEMMs are cuBLAS calls, XLA's dots and the products inside
    jmp_lab's Pallas loss kernels
    (``jmp_lab.kernels.linear_cross_entropy.gemm_flops``); the matmuls
    inside cuDNN's attention are not counted.

    * ``"total"`` = memory + GEMM: nothing overlaps, not even a GEMM's
      own operand traffic with its math. Every other inefficiency would
      make the step slower than this.
    * ``"overlapped"``: the classic per-kernel roofline. A kernel that
      runs GEMMs costs the larger of its bytes' time and its math's time
      instead of their sum; every other kernel its bytes' time. It is the
      lower of the two, and a lower bound on the step as far as each
      kernel's bytes come from memory rather than from cache. (A fusion's
      bytes are its kernel-boundary bytes here, which XLA's cost model,
      the memory term's source, can count a little differently.)

    Example (compiled for an H100: one bf16 GEMM, compute-bound, so its
    operands' bytes hide under its math)::

      >>> import jax, jax.numpy as jnp
      >>> a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
      >>> roof = compiled_report(jnp.matmul, a, a).roofline_seconds()
      >>> f"{roof['overlapped'] / roof['gemm']:.2f}", roof["gemm"] < roof["total"]
      ('1.00', True)
    """
    moved = self.bytes_accessed or float(self.kernel_io_bytes)
    bandwidth = self.target.memory_bandwidth
    memory = moved / bandwidth
    compute = sum(g.flops * g.times / self.target.peak_flops[g.math]
                  for g in self.gemms)
    hidden = sum(min(io / bandwidth, math_seconds)
                 for io, math_seconds in self._gemm_kernels().values())
    # A fusion's bytes here are its kernel-boundary bytes, the memory term's
    # XLA's cost model (they agree for library calls): never hide more than
    # the memory term counted.
    hidden = min(hidden, memory)
    return {"memory": memory, "gemm": compute, "total": memory + compute,
            "overlapped": memory + compute - hidden}

  def _gemm_kernels(self) -> dict[str, tuple[float, float]]:
    """Each kernel that runs GEMMs: its bytes and its math's seconds, per
    step (over its launches)."""
    kernels: dict[str, tuple[float, float]] = {}
    for g in self.gemms:
      io, seconds = kernels.get(g.kernel, (g.io_bytes * g.times, 0.0))
      kernels[g.kernel] = (io, seconds + g.flops * g.times
                           / self.target.peak_flops[g.math])
    return kernels

  def table(self) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    m = self.memory
    roof = self.roofline_seconds()
    lines = [
        f"compiled for {self.devices} x {self.target.name} "
        f"({_sm(self.target)}, no device)",
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
        f"GEMM {roof['gemm'] * 1e3:.3f} ms; overlapped "
        f"{roof['overlapped'] * 1e3:.3f} ms",
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
    if self.block_scaled_gemms:
      lines.append(f"block-scaled GEMMs: {len(self.block_scaled_gemms)}, "
                   f"{100 * self.block_scaled_flop_share():.1f}% of the GEMM "
                   f"FLOPs")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _sm(target: GpuTarget) -> str:
  major = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)",
                    target.config)
  return f"sm_{major.group(1)}0a" if major else "custom"


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
    walker = Walker(hlo.parse_module(text))
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
