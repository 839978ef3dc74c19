"""What a program compiled for a GPU runs, read from its optimized HLO: each
GEMM (library or Triton, its dtypes and FLOPs), each kernel launched and the
bytes at its boundary, each collective and its dtypes, each Pallas kernel.

:class:`Walker` walks the module once; :mod:`.compiled` builds its report
from what the walk found. The records are the report's fields.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Optional, Sequence

from jmp_lab.diagnostics import hlo
from jmp_lab.kernels import linear_cross_entropy as loss_kernels

_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
              "after-all", "opt-barrier", "partition-id", "replica-id",
              "call", "while", "conditional", "add-dependency", "domain"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast", "ragged-all-to-all"}
_PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class GemmRecord:
  """One GEMM (or convolution) of the compiled module."""

  kind: str                 # "cublas", "triton", "fused dot", "cudnn conv",
                            # "cudnn block-scaled" (Blackwell's MXFP8/NVFP4
                            # GEMMs) or "pallas" (jmp_lab's loss kernels)
  lhs: hlo.Array
  rhs: hlo.Array
  out: hlo.Array
  precision: str            # XLA's operand precision, e.g. "DEFAULT"
  flops: float
  times: int                # launches per step (while trip counts)
  # The kernel that runs it (the custom call or the fusion holding the dot)
  # and that kernel's operand and result bytes as the byte model counts
  # them: what ``CompiledReport.roofline_seconds`` hides under its math.
  kernel: str = ""
  io_bytes: int = 0

  @property
  def math(self) -> str:
    """The tensor-core math it runs in: fp4 (NVFP4), fp8 (also MXFP8),
    16-bit, tf32, fp32 or fp64."""
    dtypes = {self.lhs.dtype, self.rhs.dtype}
    if all(d.startswith("f4") for d in dtypes):
      return "fp4"
    if all(d.startswith("f8") for d in dtypes):
      return "fp8"
    if dtypes <= {"bf16", "f16"}:
      return "16-bit"
    if "f64" in dtypes:
      return "fp64"
    return "fp32" if self.precision.upper() == "HIGHEST" else "tf32"

  @property
  def block_scaled(self) -> Optional[str]:
    """``"mxfp8"`` or ``"nvfp4"`` for a block-scaled GEMM, else None."""
    if self.kind != "cudnn block-scaled":
      return None
    return "nvfp4" if self.math == "fp4" else "mxfp8"

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


def _without_workspace(inst: hlo.Instruction) -> list:
  """A library call's results but its scratch workspace (cuBLAS and cuDNN
  return one as a last s8/u8 result)."""
  target = inst.attribute("custom_call_target") or ""
  result = inst.result
  if ("cublas" in target or "cudnn" in target) and len(result) > 1 and (
      result[-1].dtype in ("s8", "u8")):
    return result[:-1]
  return result


def _library_gemm(inst: hlo.Instruction, result: list, times: int,
                  kernel: tuple[str, int]) -> Optional[GemmRecord]:
  """The GEMM a cuBLAS or cuDNN convolution custom call runs (None for any
  other call), run by ``kernel`` (its name and io bytes: the call itself,
  or the fusion that holds it)."""
  gemm = _library_gemm_of_call(inst, result, times)
  if gemm is None:
    return None
  name, io = kernel
  return dataclasses.replace(gemm, kernel=name, io_bytes=io)


def _library_gemm_of_call(inst: hlo.Instruction, result: list,
                          times: int) -> Optional[GemmRecord]:
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
  if "blockScaledDot" in target:
    # jax's scaled_matmul layout: (B, M, K) x (B, N, K) -> (B, M, N); its
    # scales are operands 2 and 3.
    return GemmRecord("cudnn block-scaled", lhs, rhs, result[0], "DEFAULT",
                      _dot_flops(result[0], lhs, [len(lhs.dims) - 1]), times)
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


class Walker:
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

  def fused_op_name(self, inst: hlo.Instruction) -> str:
    """The name stack of a fusion XLA made without one of its own (a
    reduction it split off, whose root it named ``reduce_max``): that of
    its fused computation's op nearest the root that has one, so that
    :meth:`CompiledReport.scope` finds it under its code's scope."""
    for computation in self.called(inst, "calls"):
      for fused in reversed(computation.instructions):
        if "/" in fused.op_name:
          return fused.op_name
    return ""

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
    op_name = inst.op_name or (self.fused_op_name(inst) if op == "fusion"
                               else "")
    self.records.append(KernelRecord(inst.name, op, op_name, io, times))
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
    kernel = (inst.name, inst.operand_bytes + sum(a.bytes for a in result))
    self.custom_call_bytes += times * kernel[1]
    config = inst.backend_config()
    library_gemm = _library_gemm(inst, result, times, kernel)
    if library_gemm is not None:
      self.gemms.append(library_gemm)
    elif target.startswith(_PALLAS_TARGETS):
      name = config.get("name") or _pallas_name(inst)
      self.pallas.append((name, "mosaic" if "mosaic" in target else "triton"))
      if len(inst.operand_types) >= 2:
        lhs, rhs = inst.operand_types[0][0], inst.operand_types[1][0]
        flops = loss_kernels.gemm_flops(name, lhs.dims, rhs.dims)
        if flops:  # jmp_lab's own kernels that are GEMMs inside
          self.gemms.append(GemmRecord(
              "pallas", lhs, rhs, result[0], "DEFAULT", flops, times,
              *kernel))

  def fusion(self, inst: hlo.Instruction, times: int) -> None:
    kind = (inst.backend_config().get("fusion_backend_config", {})
            .get("kind", ""))
    label = ("triton" if "triton" in kind else
             "cublas" if "cublas" in kind else "fused dot")
    kernel = (inst.name, self.io_bytes(inst))
    for comp in self.called(inst, "calls"):
      # jax 0.12's XLA puts a cuBLAS call that reads a dynamic slice (a
      # scanned layer's weight) inside a "dynamic slice fusion".
      for call in comp.instructions:
        if call.opcode == "custom-call":
          library_gemm = _library_gemm(call, _without_workspace(call), times,
                                       kernel)
          if library_gemm is not None:
            self.gemms.append(library_gemm)
      for dot in self.dots(comp):
        lhs, rhs = dot.operand_types[0][0], dot.operand_types[1][0]
        precision = re.search(r"operand_precision=\{(\w+)", dot.attributes)
        self.gemms.append(GemmRecord(
            label, lhs, rhs, dot.result[0],
            precision.group(1).upper() if precision else "DEFAULT",
            _dot_flops(dot.result[0], lhs,
                       _dims(dot.attribute("lhs_contracting_dims"))), times,
            *kernel))

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


__all__ = ["CollectiveRecord", "GemmRecord", "KernelRecord", "PallasKernel",
           "ThunkRecord", "Walker"]
