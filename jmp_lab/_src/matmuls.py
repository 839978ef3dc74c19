"""The matmuls of a jaxpr: every dot_general and convolution, with its
operand dtypes, shapes, FLOPs and where it was written.

The library asks this of a traced loss (:mod:`jmp_lab._src.precision_warnings`
warns when a half policy's matmuls all run in fp32) and
:func:`jmp_lab.diagnostics.audit_step` reports it; both read the one walk
here, so diagnostics sit on top of the library rather than under it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jmp_lab._src.user_warnings import in_jmp_lab

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
FP8_DTYPES = tuple(np.dtype(getattr(jnp, n)) for n in (
    "float8_e4m3fn", "float8_e5m2") if hasattr(jnp, n))


def gemm_accumulation(operand_dtypes: tuple[str, ...]) -> str:
  """The type a GPU GEMM of these operands accumulates in: fp32 for fp16,
  bf16, fp8 and fp32 operands (cuBLAS's compute type as XLA calls it;
  tensor cores add fp16 and bf16 products in fp32 whatever the result
  type), fp64 for fp64, int32 for integers.

  Example::

    >>> gemm_accumulation(("float16", "float16"))
    'float32'
  """
  dtypes = [np.dtype(d) for d in operand_dtypes]
  if any(d == np.float64 for d in dtypes):
    return "float64"
  if all(np.issubdtype(d, np.integer) for d in dtypes):
    return "int32"
  return "float32"


@dataclasses.dataclass
class MatmulRecord:
  kind: str                       # "dot_general", "conv", "mxfp8" /
                                  # "nvfp4" (a block-scaled GEMM) or
                                  # "hadamard" (NVFP4's transform)
  operand_dtypes: tuple[str, str]
  accumulation_dtype: str         # the result's dtype (the dot's
                                  # preferred_element_type, or its operands')
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  flops: float
  tensor_core_dims: bool          # M, N, K multiples of 8 (16 for fp8)
  odd_dims: tuple[str, ...]       # which of M/N/K miss that multiple
  location: str
  times: int = 1                  # trip count of enclosing scans
  # Both operands dequantized from fp8 just before (quantize-dequantize,
  # jmp_lab.fp8): XLA:GPU runs such a matmul as an fp8 GEMM.
  fp8: bool = False
  # "mxfp8" or "nvfp4": a block-scaled GEMM (jmp_lab.block_scaled), which a
  # CUDA compile runs as jax's scaled_matmul and a CPU emulates.
  block_scaled: Optional[str] = None

  @property
  def half(self) -> bool:
    return self.block_scaled is not None or all(
        np.dtype(d) in HALF_DTYPES + FP8_DTYPES for d in self.operand_dtypes)


def contracts_nothing(lhs: Any, dimension_numbers) -> bool:
  """Whether ``lax.dot_general(lhs, _, dimension_numbers)`` sums over one
  value or none (an elementwise scale written as an einsum, a one-hot
  dispatch's batch product): no GEMM, so the fp8 and block-scaled products
  leave it in the compute dtype rather than round both operands for
  nothing."""
  (lhs_contracting, _), _ = dimension_numbers
  return math.prod(jnp.shape(lhs)[d] for d in lhs_contracting) == 1


def _dot_dims(eqn):
  return _product_dims(eqn, eqn.params["dimension_numbers"])


def _ragged_dims(eqn):
  """A grouped GEMM's (``lax.ragged_dot``, a mixture of experts'): each
  row (or, ragged along the contraction, each contraction index) meets one
  group's matrix, so its FLOPs are those of one dense product of the
  operands without the group axis."""
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  return _product_dims(eqn, numbers.dot_dimension_numbers,
                       numbers.rhs_group_dimensions)


def _product_dims(eqn, dimension_numbers, rhs_groups=()):
  """M, N, K and the FLOPs of a product of ``eqn``'s two operands."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  k = math.prod(lhs[d] for d in lhs_contract)
  batch = math.prod(lhs[d] for d in lhs_batch)
  m = math.prod(s for d, s in enumerate(lhs)
                if d not in lhs_contract and d not in lhs_batch)
  n = math.prod(s for d, s in enumerate(rhs)
                if d not in (*rhs_contract, *rhs_batch, *rhs_groups))
  return {"M": m, "N": n, "K": k}, 2.0 * batch * m * n * k


def _conv_dims(eqn):
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  out = eqn.outvars[0].aval.shape
  dn = eqn.params["dimension_numbers"]
  groups = eqn.params.get("feature_group_count", 1)
  in_features = rhs[dn.rhs_spec[1]]
  out_features = rhs[dn.rhs_spec[0]]
  window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
  out_pixels = math.prod(out) // out[dn.out_spec[1]]
  dims = {"M": out_pixels, "N": out_features, "K": in_features * window}
  flops = 2.0 * out_pixels * out_features * in_features * window
  del lhs, groups  # grouped convs: in_features is already per group
  return dims, flops


#: The matmul primitives the audit counts, with their dimensions and FLOPs.
_GEMM_DIMS = {"dot_general": _dot_dims, "conv_general_dilated": _conv_dims,
              "ragged_dot_general": _ragged_dims}


def _user_location(eqn, enclosing: str = "?") -> str:
  """``file:line`` of the code that produced ``eqn``: the first frame that
  is neither jax's (jax's own view of user code) nor jmp_lab's, so a
  layer's block-scaled or fp8 product is found at the layer's call, as its
  bf16 one is. Where there is none (an op jmp_lab traces without its call
  site, so that XLA merges its copies: NVFP4's Hadamard transform), the
  op's layer by its name scopes (``MLP/Dense_0``), else ``enclosing`` (the
  location of the op around it)."""
  try:
    from jax._src import source_info_util  # no public equivalent
    frame = next((f for f in source_info_util.user_frames(
        eqn.source_info.traceback) if not in_jmp_lab(f.file_name)), None)
  except Exception:  # pylint: disable=broad-except
    frame = None
  if frame is not None:
    return f"{frame.file_name.split('/')[-1]}:{frame.start_line}"
  scopes = str(getattr(eqn.source_info, "name_stack", "")).split("/")
  # Not a layer: jit names, jmp_lab's scopes, an einsum's equation.
  return "/".join(p for p in scopes if p and "(" not in p and "->" not in p
                  and not p.startswith("jmp_lab")) or enclosing


def hadamards_located(records: list) -> list:
  """``records`` with each Hadamard GEMM that has no layer to name (NNX
  modules open no name scopes) at the block-scaled GEMM it feeds: the next
  one in program order (the input's transform precedes its layer's
  forward GEMM, the output gradient's its layer's gradient GEMMs)."""
  located = list(records)
  for i, record in enumerate(located):
    if record.kind != "hadamard" or record.location != "?":
      continue
    fed = next((r for r in located[i + 1:] if r.kind in ("mxfp8", "nvfp4")),
               None)
    if fed is not None:
      located[i] = dataclasses.replace(record, location=fed.location)
  return located


# Ops a dequantized fp8 value passes through on its way to a matmul: the
# dequantize itself (convert, multiply by the scale) and layout changes.
_DEQUANTIZE_PATH = {"convert_element_type", "mul", "broadcast_in_dim",
                    "reshape", "transpose", "copy", "copy_p"}


def _inner_jaxpr(eqn):
  """The jaxpr a call-like eqn (pjit, custom_vjp_call...) runs, if its
  outputs are that jaxpr's outputs."""
  for param in eqn.params.values():
    inner = getattr(param, "jaxpr", param)
    if hasattr(inner, "eqns") and len(inner.outvars) == len(eqn.outvars):
      return inner
  return None


@dataclasses.dataclass(frozen=True)
class _Operand:
  """An input of a sub-jaxpr: the enclosing equation's operand ``var``,
  produced in the enclosing scope (``producers``)."""
  var: Any
  producers: dict


def _scope(inner, eqn, producers: dict) -> dict:
  """The producers of ``inner``'s variables, its inputs included (traced on
  to the enclosing ``eqn``'s operands when they correspond one to one: the
  bodies of jit, checkpoint, scan). A value dequantized outside a
  rematerialized body and used inside it is then still seen as fp8."""
  scope = {}
  if len(inner.invars) == len(eqn.invars):
    scope = {inside: _Operand(outside, producers)
             for inside, outside in zip(inner.invars, eqn.invars)
             if type(outside).__name__ != "Literal"}
  scope.update(_producers(inner))
  return scope


def _from_fp8(var, producers, depth=0) -> bool:
  """Whether ``var`` is a value dequantized from an fp8 array."""
  eqn = producers.get(var)
  if eqn is None or depth > 12:
    return False
  if isinstance(eqn, _Operand):
    return _from_fp8(eqn.var, eqn.producers, depth + 1)
  name = eqn.primitive.name
  if name == "convert_element_type" and np.dtype(
      eqn.invars[0].aval.dtype) in FP8_DTYPES:
    return True
  if name in _DEQUANTIZE_PATH:
    return any(_from_fp8(v, producers, depth + 1) for v in eqn.invars
               if type(v).__name__ != "Literal")
  inner = _inner_jaxpr(eqn)
  if inner is not None:
    out = inner.outvars[eqn.outvars.index(var)]
    return _from_fp8(out, _scope(inner, eqn, producers), depth + 1)
  return False


def _producers(jaxpr) -> dict:
  return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def walk(jaxpr, times, records, casts, producers=None, location="?"):
  """Appends ``jaxpr``'s matmuls to ``records`` (each run ``times`` times:
  scan trip counts multiply) and counts its float casts in ``casts``,
  entering every sub-jaxpr a GPU compile runs (``location``: the user's
  line of the op whose sub-jaxpr this is)."""
  producers = _producers(jaxpr) if producers is None else producers
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    block_scaled = _block_scaled_gemm(eqn)
    if block_scaled is not None:
      records.append(_block_scaled_record(block_scaled, eqn, times,
                                          location))
      continue
    if name in _GEMM_DIMS:
      dims, flops = _GEMM_DIMS[name](eqn)
      dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2])
      fp8 = all(_from_fp8(v, producers) for v in eqn.invars[:2])
      multiple = 16 if fp8 or all(d in FP8_DTYPES for d in dtypes) else 8
      odd = tuple(k for k, v in dims.items() if v % multiple)
      accumulation = eqn.params.get("preferred_element_type") or np.result_type(
          *dtypes)
      records.append(MatmulRecord(
          kind=_matmul_kind(eqn),
          operand_dtypes=tuple(d.name for d in dtypes),
          accumulation_dtype=np.dtype(accumulation).name,
          lhs_shape=tuple(eqn.invars[0].aval.shape),
          rhs_shape=tuple(eqn.invars[1].aval.shape),
          out_shape=tuple(eqn.outvars[0].aval.shape),
          flops=flops * times,
          tensor_core_dims=not odd, odd_dims=odd,
          location=_user_location(eqn, location),
          times=times,
          fp8=fp8))
    elif name == "convert_element_type":
      src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
      if jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating):
        casts[f"{np.dtype(src).name}->{np.dtype(dst).name}"] = casts.get(
            f"{np.dtype(src).name}->{np.dtype(dst).name}", 0) + times
    inner_times = times * (eqn.params.get("length", 1) if name == "scan" else 1)
    subs = list(compiled_sub_jaxprs(eqn))
    inner_location = _user_location(eqn, location) if subs else location
    for inner in subs:
      walk(inner, inner_times, records, casts,
           _scope(inner, eqn, producers), inner_location)


#: The named scope jmp_lab.block_scaled quantizes in (its random Hadamard
#: transform is a small GEMM there).
BLOCK_QUANTIZE_SCOPE = "jmp_lab_block_quantize"


def _matmul_kind(eqn) -> str:
  """``"conv"``, ``"ragged_dot"`` (a grouped GEMM), ``"hadamard"`` (the
  16-wide transform of NVFP4's weight gradient operands: part of a
  block-scaled GEMM's quantization) or ``"dot_general"``."""
  if eqn.primitive.name == "ragged_dot_general":
    return "ragged_dot"
  if eqn.primitive.name != "dot_general":
    return "conv"
  stack = str(getattr(eqn.source_info, "name_stack", ""))
  return "hadamard" if BLOCK_QUANTIZE_SCOPE in stack else "dot_general"


def _block_scaled_gemm(eqn) -> Optional[Any]:
  """The ``scaled_matmul`` equation of a ``lax.platform_dependent`` choice
  whose CUDA branch runs one (:mod:`jmp_lab.block_scaled`), else None."""
  platforms = eqn.params.get("branches_platforms") if (
      eqn.primitive.name == "cond") else None
  if not platforms:
    return None
  for branch, names in zip(eqn.params["branches"], platforms):
    if names and "cuda" in names:
      return _find_scaled_matmul(branch.jaxpr)
  return None


def _find_scaled_matmul(jaxpr, depth: int = 0) -> Optional[Any]:
  for eqn in jaxpr.eqns:
    if "scaled_matmul" in eqn.primitive.name and len(eqn.invars) == 4:
      return eqn
    for inner in sub_jaxprs(eqn.params) if depth < 4 else ():
      found = _find_scaled_matmul(inner, depth + 1)
      if found is not None:
        return found
  return None


def _block_scaled_record(eqn, outer, times: int,
                         location: str = "?") -> MatmulRecord:
  """A ``scaled_matmul`` (``(B, M, K) x (B, N, K)``) as a record."""
  lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
  dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2])
  flops = 2.0 * lhs[0] * lhs[1] * rhs[1] * lhs[2]
  fmt = "nvfp4" if "float4" in dtypes[0].name else "mxfp8"
  return MatmulRecord(
      kind=fmt, operand_dtypes=tuple(d.name for d in dtypes),
      accumulation_dtype="float32", lhs_shape=lhs, rhs_shape=rhs,
      out_shape=(lhs[0], lhs[1], rhs[1]), flops=flops * times,
      tensor_core_dims=True, odd_dims=(), location=_user_location(outer, location),
      times=times, block_scaled=fmt)


def compiled_sub_jaxprs(eqn):
  """The sub-jaxprs of ``eqn`` that a GPU compile of it runs, as
  :func:`sub_jaxprs`, except that of a ``lax.platform_dependent`` choice
  only the default branch: one branch runs, so counting all would count
  its matmuls twice, and the CPU branch of ``jmp_lab._gemm.accumulated`` is
  a workaround for XLA:CPU, not the step. The audit counts these."""
  platforms = eqn.params.get("branches_platforms") if (
      eqn.primitive.name == "cond") else None
  if platforms and None in platforms:
    yield eqn.params["branches"][platforms.index(None)].jaxpr
    return
  yield from sub_jaxprs(eqn.params)


def sub_jaxprs(params: dict):
  """Every jaxpr among an equation's params, closed or open.

  The bodies of ``jax.checkpoint`` (``nn.remat``) and ``shard_map`` are open
  jaxprs; ``scan``, ``cond``, ``jit`` and custom derivatives hold closed
  ones, whose ``.jaxpr`` is the body (jax 0.12 merges the two kinds). A walk
  that follows ``.jaxpr`` alone misses the open ones.
  """
  for param in params.values():
    for sub in param if isinstance(param, (list, tuple)) else (param,):
      if hasattr(sub, "eqns"):
        yield sub
      elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
        yield sub.jaxpr


def matmul_records(closed_jaxpr: Any) -> list[MatmulRecord]:
  """Every matmul and convolution of a (closed) jaxpr, sub-jaxprs included:
  the records :func:`audit_step` reports, without lowering."""
  jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
  records: list[MatmulRecord] = []
  walk(jaxpr, 1, records, {})
  return hadamards_located(records)
