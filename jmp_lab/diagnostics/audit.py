"""Step audit: the matmuls, convolutions and casts of a traced function.

:func:`audit_step` walks the jaxpr of any function (a whole train step
included: ``grad``, ``scan`` and ``jit`` bodies are entered) and reports every
matmul's operand and accumulation dtypes, shapes, tensor-core friendliness
and share of the FLOPs, the fp32 matmuls a half policy could run in half, and
the casts. It is the trace-level view; :func:`jmp_lab.diagnostics.
compiled_report` is the same question asked of the module compiled for a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np

from jmp_lab._src.matmuls import (FP8_DTYPES, HALF_DTYPES, MatmulRecord,
                                  compiled_sub_jaxprs, gemm_accumulation,
                                  hadamards_located, matmul_records,
                                  sub_jaxprs, walk)
from jmp_lab._src.policy import Policy, get_policy

# --------------------------------------------------------------------------
# Step audit: matmuls, convolutions and casts of a traced function.
# --------------------------------------------------------------------------

@dataclasses.dataclass
class AuditReport:
  """The matmuls and casts of one traced function (see :func:`audit_step`).

  Attributes:
    matmuls: every dot_general and convolution, as :class:`MatmulRecord`.
    total_flops: their FLOPs, scan trip counts included.
    half_flop_share: the share of those FLOPs with half or fp8 operands.
    fp8_flop_share: the share run as fp8 GEMMs: both operands fp8, or
      dequantized from fp8 just before (jmp_lab's fp8 policies).
    block_scaled_flop_share: the share run as block-scaled GEMMs (rows of
      kind ``"mxfp8"`` or ``"nvfp4"``, :mod:`jmp_lab.block_scaled`).
    fp32_could_be_half: fp32 matmuls under a policy with a half compute dtype.
    off_tensor_core: matmuls whose M/N/K miss a multiple of 8 (16 for fp8).
    casts: float-to-float conversions by kind, in the jaxpr.
    hlo_converts: convert ops in the lowered module.
    policy: the policy audited against, if any.
  """

  matmuls: list[MatmulRecord]
  total_flops: float
  half_flop_share: float
  fp32_could_be_half: list[MatmulRecord]
  off_tensor_core: list[MatmulRecord]
  casts: dict[str, int]
  hlo_converts: int
  policy: Optional[Policy] = None

  @property
  def fp8_flop_share(self) -> float:
    fp8_flops = sum(r.flops for r in self.matmuls if r.fp8 or all(
        np.dtype(d) in FP8_DTYPES for d in r.operand_dtypes))
    return fp8_flops / self.total_flops

  @property
  def block_scaled_flop_share(self) -> float:
    return sum(r.flops for r in self.matmuls
               if r.block_scaled) / self.total_flops

  @property
  def num_casts(self) -> int:
    return sum(self.casts.values())

  def table(self) -> str:
    """One row per matmul, largest first, and a summary line."""
    return _audit_table(self)

  def __str__(self) -> str:
    return self.table()


def audit_step(fn: Callable[..., Any], *args, policy: Any = None,
               **kwargs) -> AuditReport:
  """Audits every matmul and convolution of ``fn(*args, **kwargs)``.

  The function is traced (its jaxpr, including what ``jax.grad``, ``scan``
  and ``jit`` put inside it) and lowered, so a jitted train step can be
  audited as it is.

  Args:
    fn: any function, e.g. a train step.
    args, kwargs: example arguments of ``fn`` (arrays or ShapeDtypeStructs).
    policy: the policy the step is meant to follow; with a half compute
      dtype, fp32 matmuls are reported as could-be-half.

  Returns:
    An :class:`AuditReport`; ``print(report)`` shows its table.

  Example::

    >>> import jax.numpy as jnp
    >>> from jmp_lab.diagnostics import audit_step
    >>> def f(w, x):
    ...   return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).sum()
    >>> report = audit_step(f, jnp.ones((64, 32)), jnp.ones((16, 64)))
    >>> report.half_flop_share, len(report.matmuls), report.off_tensor_core
    (1.0, 1, [])
  """
  policy = get_policy(policy) if policy is not None else None
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  records: list[MatmulRecord] = []
  casts: dict[str, int] = {}
  walk(closed.jaxpr, 1, records, casts)
  records = hadamards_located(records)
  lowered = jax.jit(fn).lower(*args, **kwargs).as_text()
  total = sum(r.flops for r in records) or 1.0
  half_flops = sum(r.flops for r in records if r.half)
  could_be_half = []
  if policy is not None and policy.compute_dtype in HALF_DTYPES:
    could_be_half = [r for r in records if not r.half and
                     all(d == "float32" for d in r.operand_dtypes)]
  return AuditReport(
      matmuls=records, total_flops=total, half_flop_share=half_flops / total,
      fp32_could_be_half=could_be_half,
      off_tensor_core=[r for r in records if not r.tensor_core_dims],
      casts=casts, hlo_converts=lowered.count("stablehlo.convert"),
      policy=policy)


def _audit_table(report: AuditReport) -> str:
  lines = [f"{'op':<11} {'operands':<18} {'out':<9}{'acc':<8} "
           f"{'lhs x rhs -> out':<40} {'FLOP %':>7}  {'TC dims':<8} where"]
  for r in sorted(report.matmuls, key=lambda r: -r.flops):
    shapes = f"{list(r.lhs_shape)}x{list(r.rhs_shape)}->{list(r.out_shape)}"
    tc = "ok" if r.tensor_core_dims else "odd " + "".join(r.odd_dims)
    flag = "  <- fp32, could be half" if r in report.fp32_could_be_half else ""
    flag += "  (fp8 GEMM)" if r.fp8 else ""
    lines.append(
        f"{r.kind:<11} {'/'.join(r.operand_dtypes):<18} "
        f"{r.accumulation_dtype:<9}{gemm_accumulation(r.operand_dtypes):<8} "
        f"{shapes:<40} {100 * r.flops / report.total_flops:6.2f}%  {tc:<8} "
        f"{r.location}{flag}")
  lines.append(
      f"half-precision share of matmul FLOPs: {100 * report.half_flop_share:.1f}%"
      + (f" (fp8: {100 * report.fp8_flop_share:.1f}%)"
         if report.fp8_flop_share else "")
      + (f" (block-scaled: {100 * report.block_scaled_flop_share:.1f}%)"
         if report.block_scaled_flop_share else "")
      + f"; fp32 matmuls the policy could run in half: "
      f"{len(report.fp32_could_be_half)}; off tensor-core dims: "
      f"{len(report.off_tensor_core)}; float casts: {report.num_casts} "
      f"({report.hlo_converts} converts in the lowered module)"
      + (f"; policy {report.policy}" if report.policy else ""))
  return "\n".join(lines)


__all__ = [
    "audit_step",
    "AuditReport",
    "compiled_sub_jaxprs",
    "matmul_records",
    "MatmulRecord",
    "sub_jaxprs",
]
