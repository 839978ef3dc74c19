"""Diagnostics: see what mixed precision is doing to your model.

* :func:`gradient_histogram` -- log2 buckets of |g| per leaf and in total,
  against the fp16 and bf16 representable ranges, with the share that would
  underflow or overflow at a loss scale and the scales that avoid both;
  :func:`plot_gradient_histogram` draws it in the style of the mixed
  precision paper's activation-gradient histogram.
* :func:`audit_step` -- every matmul and convolution of a traced function:
  operand and accumulation dtypes, shapes, tensor-core friendliness, share of
  the FLOPs; matmuls left in fp32 that the policy could run in half; casts.
* :func:`memory_report` -- compiled memory figures, parameter/optimizer bytes
  per parameter and activation bytes saved for the backward pass, per policy.
* :class:`TrainingRecorder` -- a host-side recorder of the loss, loss scale
  and skipped steps that never synchronises inside a step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab import _tree
from jmp_lab.policy import get_policy

# --------------------------------------------------------------------------
# Representable ranges.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FloatRange:
  """The magnitudes a floating format can hold."""

  name: str
  min_subnormal: float
  min_normal: float
  max: float


FP16 = FloatRange("float16", 2.0**-24, 2.0**-14, 65504.0)
BF16 = FloatRange("bfloat16", 2.0**-133, 2.0**-126,
                  float(jnp.finfo(jnp.bfloat16).max))
RANGES = {"float16": FP16, "bfloat16": BF16}

# --------------------------------------------------------------------------
# Gradient-range histogram.
# --------------------------------------------------------------------------

MIN_EXPONENT, MAX_EXPONENT = -140, 130  # covers bf16/fp32 normal + subnormal


@dataclasses.dataclass
class GradientHistogram:
  """Counts of |g| in log2 buckets.

  Bucket ``i`` holds values with ``2**e <= |g| < 2**(e+1)`` for
  ``e = exponents[i]``. Zeros and non-finite values are counted apart.
  """

  exponents: np.ndarray                  # bucket lower exponents
  total: np.ndarray                      # counts over every leaf
  per_leaf: dict[str, np.ndarray]
  zeros: int
  non_finite: int
  smallest: float                        # smallest nonzero finite |g|
  largest: float                         # largest finite |g|

  @property
  def nonzero(self) -> int:
    return int(self.total.sum())

  def share_underflowing(self, loss_scale: float = 1.0,
                         fmt: FloatRange = FP16) -> float:
    """Share of nonzero finite |g| that flush to zero in ``fmt`` at the scale.

    A value flushes to zero when ``|g| * scale`` is below half the smallest
    subnormal; bucket edges decide, so values in the boundary bucket count
    as flushed (an upper bound within one bucket).
    """
    limit = math.log2(fmt.min_subnormal / 2 / loss_scale)
    return self._share(self.exponents + 1 <= limit + 1e-9)

  def share_subnormal(self, loss_scale: float = 1.0,
                      fmt: FloatRange = FP16) -> float:
    """Share that lands in ``fmt``'s subnormal range (reduced precision)."""
    low = math.log2(fmt.min_subnormal / 2 / loss_scale)
    high = math.log2(fmt.min_normal / loss_scale)
    return self._share((self.exponents >= low) & (self.exponents + 1 <= high + 1e-9))

  def share_overflowing(self, loss_scale: float = 1.0,
                        fmt: FloatRange = FP16) -> float:
    """Share of nonzero finite |g| that overflow ``fmt`` at the scale."""
    limit = math.log2(fmt.max / loss_scale)
    return self._share(self.exponents >= limit - 1e-9)

  def safe_scales(self, fmt: FloatRange = FP16) -> tuple[float, float]:
    """The loss scales that keep every nonzero |g| representable in ``fmt``.

    Returns ``(low, high)``: below ``low`` the smallest gradient flushes to
    zero, above ``high`` the largest overflows. ``low > high`` means no
    single scale keeps them all.
    """
    if self.nonzero == 0:
      return (0.0, math.inf)
    return (fmt.min_subnormal / self.smallest, fmt.max / self.largest)

  def _share(self, mask: np.ndarray) -> float:
    return float(self.total[mask].sum() / max(self.nonzero, 1))


def _exponent_counts(x: jax.Array):
  magnitude = jnp.abs(x.astype(jnp.float32)).ravel()
  finite = jnp.isfinite(magnitude)
  counted = finite & (magnitude > 0)
  # frexp: x = m * 2**e with 0.5 <= m < 1, so floor(log2 x) = e - 1, exact
  # (unlike log2, which rounds near powers of two).
  _, e = jnp.frexp(jnp.where(counted, magnitude, 1.0))
  index = jnp.clip(e - 1 - MIN_EXPONENT, 0, MAX_EXPONENT - MIN_EXPONENT)
  counts = jnp.zeros(MAX_EXPONENT - MIN_EXPONENT + 1, jnp.int32).at[index].add(
      counted.astype(jnp.int32))
  zeros = jnp.sum(finite & (magnitude == 0))
  smallest = jnp.min(jnp.where(counted, magnitude, jnp.inf))
  largest = jnp.max(jnp.where(counted, magnitude, 0.0))
  return counts, zeros, jnp.sum(~finite), smallest, largest


def gradient_histogram(grads: Any) -> GradientHistogram:
  """Log2 histogram of |g| over the floating leaves of ``grads``.

  Pass *unscaled* gradients (``loss_scale.unscale(grads)``) to ask what a
  given scale would do; pass scaled ones to see what the step saw.
  """
  per_leaf, zeros, non_finite = {}, 0, 0
  smallest, largest = math.inf, 0.0
  for path, leaf in _tree.leaves_with_paths(grads):
    if not _tree.is_floating_array(leaf) or leaf.size == 0:
      continue
    # Reduced on device: only the counts and four scalars come back.
    counts, z, nf, low, high = jax.device_get(jax.jit(_exponent_counts)(leaf))
    per_leaf[path] = np.asarray(counts)
    zeros += int(z)
    non_finite += int(nf)
    smallest = min(smallest, float(low))
    largest = max(largest, float(high))
  exponents = np.arange(MIN_EXPONENT, MAX_EXPONENT + 1)
  total = (np.sum(list(per_leaf.values()), axis=0) if per_leaf
           else np.zeros_like(exponents))
  return GradientHistogram(exponents, total, per_leaf, zeros, non_finite,
                           smallest if smallest < math.inf else 0.0, largest)


def plot_gradient_histogram(hist: GradientHistogram, *,
                            loss_scale: Optional[float] = None,
                            title: str = "gradient magnitudes", ax=None):
  """Draws the histogram with the fp16 and bf16 ranges marked.

  Returns the matplotlib figure. With ``loss_scale`` the fp16 limits are
  drawn where they fall for *unscaled* gradients at that scale.
  """
  import matplotlib.pyplot as plt
  if ax is None:
    fig, ax = plt.subplots(figsize=(9, 3.8))
  else:
    fig = ax.figure
  shift = math.log2(loss_scale) if loss_scale else 0.0
  fp16_low = math.log2(FP16.min_subnormal) - shift
  fp16_high = math.log2(FP16.max) - shift
  used = hist.exponents[hist.total > 0]
  left = math.floor(min(used.min() if used.size else 0, fp16_low)) - 3
  right = math.ceil(max(used.max() + 1 if used.size else 0, fp16_high)) + 3
  shown = (hist.exponents >= left) & (hist.exponents <= right)
  share = 100 * hist.total / max(hist.nonzero, 1)
  ax.bar(hist.exponents[shown] + 0.5, share[shown], width=0.9,
         color="tab:blue", label="gradients")
  ax.axvspan(left, fp16_low - 1, color="tab:red", alpha=0.12,
             label="fp16 flushes to zero")
  ax.axvline(fp16_low, color="tab:red", ls="--", label="fp16 min subnormal 2^-24")
  ax.axvline(math.log2(FP16.min_normal) - shift, color="tab:orange", ls="--",
             label="fp16 min normal 2^-14")
  ax.axvline(fp16_high, color="tab:purple", ls="--", label="fp16 max 65504")
  ax.set_xlim(left, right)
  if math.log2(BF16.min_normal) >= left:
    ax.axvline(math.log2(BF16.min_normal), color="tab:green", ls=":",
               label="bf16 min normal 2^-126")
  suffix = f" (fp16 limits shifted by loss scale {loss_scale:g})" if loss_scale else ""
  ax.set(xlabel="log2(|gradient|)", ylabel="% of nonzero values",
         title=title + suffix)
  ax.legend(fontsize=7, loc="upper left")
  fig.tight_layout()
  return fig


# --------------------------------------------------------------------------
# Step audit: matmuls, convolutions and casts of a traced function.
# --------------------------------------------------------------------------

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
FP8_DTYPES = tuple(np.dtype(getattr(jnp, n)) for n in (
    "float8_e4m3fn", "float8_e5m2") if hasattr(jnp, n))


@dataclasses.dataclass
class MatmulRecord:
  kind: str                       # "dot_general" or "conv"
  operand_dtypes: tuple[str, str]
  accumulation_dtype: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  flops: float
  tensor_core_dims: bool          # M, N, K multiples of 8 (16 for fp8)
  odd_dims: tuple[str, ...]       # which of M/N/K miss that multiple
  location: str
  times: int = 1                  # trip count of enclosing scans

  @property
  def half(self) -> bool:
    return all(np.dtype(d) in HALF_DTYPES + FP8_DTYPES for d in self.operand_dtypes)


def _dot_dims(eqn):
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params[
      "dimension_numbers"]
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  k = math.prod(lhs[d] for d in lhs_contract)
  batch = math.prod(lhs[d] for d in lhs_batch)
  m = math.prod(s for d, s in enumerate(lhs)
                if d not in lhs_contract and d not in lhs_batch)
  n = math.prod(s for d, s in enumerate(rhs)
                if d not in rhs_contract and d not in rhs_batch)
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


def _user_location(eqn) -> str:
  """``file:line`` of the user code that produced ``eqn`` (jax's own view)."""
  try:
    from jax._src import source_info_util  # no public equivalent
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return (f"{frame.file_name.split('/')[-1]}:{frame.start_line}"
            if frame else "?")
  except Exception:  # pylint: disable=broad-except
    return "?"


def _walk(jaxpr, times, records, casts):
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "conv_general_dilated"):
      dims, flops = (_dot_dims if name == "dot_general" else _conv_dims)(eqn)
      dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2])
      multiple = 16 if all(d in FP8_DTYPES for d in dtypes) else 8
      odd = tuple(k for k, v in dims.items() if v % multiple)
      accumulation = eqn.params.get("preferred_element_type") or np.result_type(
          *dtypes)
      records.append(MatmulRecord(
          kind="dot_general" if name == "dot_general" else "conv",
          operand_dtypes=tuple(d.name for d in dtypes),
          accumulation_dtype=np.dtype(accumulation).name,
          lhs_shape=tuple(eqn.invars[0].aval.shape),
          rhs_shape=tuple(eqn.invars[1].aval.shape),
          out_shape=tuple(eqn.outvars[0].aval.shape),
          flops=flops * times,
          tensor_core_dims=not odd, odd_dims=odd,
          location=_user_location(eqn),
          times=times))
    elif name == "convert_element_type":
      src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
      if jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating):
        casts[f"{np.dtype(src).name}->{np.dtype(dst).name}"] = casts.get(
            f"{np.dtype(src).name}->{np.dtype(dst).name}", 0) + times
    inner_times = times * (eqn.params.get("length", 1) if name == "scan" else 1)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          _walk(inner if hasattr(inner, "eqns") else inner.jaxpr,
                inner_times, records, casts)


def audit_step(fn: Callable[..., Any], *args, policy: Any = None,
               **kwargs) -> dict[str, Any]:
  """Audits every matmul and convolution of ``fn(*args, **kwargs)``.

  The function is traced (its jaxpr, including what ``jax.grad``, ``scan``
  and ``jit`` put inside it) and lowered, so a jitted train step can be
  audited as it is.

  Args:
    fn: any function, e.g. a train step.
    *args, **kwargs: example arguments (arrays or ShapeDtypeStructs).
    policy: the policy the step is meant to follow; with a half compute
      dtype, fp32 matmuls are reported as could-be-half.

  Returns:
    A dict: ``matmuls`` (list of :class:`MatmulRecord`), ``half_flop_share``,
    ``fp32_could_be_half`` (records), ``off_tensor_core`` (records whose
    dims are not multiples of 8/16), ``casts`` (float->float conversions by
    kind, trace-level), ``hlo_converts`` (convert ops in the lowered module),
    ``total_flops`` and ``table`` (text).
  """
  policy = get_policy(policy) if policy is not None else None
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  records: list[MatmulRecord] = []
  casts: dict[str, int] = {}
  _walk(closed.jaxpr, 1, records, casts)
  lowered = jax.jit(fn).lower(*args, **kwargs).as_text()
  total = sum(r.flops for r in records) or 1.0
  half_flops = sum(r.flops for r in records if r.half)
  could_be_half = []
  if policy is not None and policy.compute_dtype in HALF_DTYPES:
    could_be_half = [r for r in records if not r.half and
                     all(d == "float32" for d in r.operand_dtypes)]
  report = {
      "matmuls": records,
      "total_flops": total,
      "half_flop_share": half_flops / total,
      "fp32_could_be_half": could_be_half,
      "off_tensor_core": [r for r in records if not r.tensor_core_dims],
      "casts": casts,
      "num_casts": sum(casts.values()),
      "hlo_converts": lowered.count("stablehlo.convert"),
  }
  report["table"] = _audit_table(report, policy)
  return report


def _audit_table(report, policy) -> str:
  lines = [f"{'op':<11} {'operands':<18} {'acc':<8} {'lhs x rhs -> out':<40} "
           f"{'FLOP %':>7}  {'TC dims':<8} where"]
  for r in sorted(report["matmuls"], key=lambda r: -r.flops):
    shapes = f"{list(r.lhs_shape)}x{list(r.rhs_shape)}->{list(r.out_shape)}"
    tc = "ok" if r.tensor_core_dims else "odd " + "".join(r.odd_dims)
    flag = "  <- fp32, could be half" if r in report["fp32_could_be_half"] else ""
    lines.append(
        f"{r.kind:<11} {'/'.join(r.operand_dtypes):<18} {r.accumulation_dtype:<8} "
        f"{shapes:<40} {100 * r.flops / report['total_flops']:6.2f}%  {tc:<8} "
        f"{r.location}{flag}")
  lines.append(
      f"half-precision share of matmul FLOPs: {100 * report['half_flop_share']:.1f}%"
      f"; fp32 matmuls the policy could run in half: "
      f"{len(report['fp32_could_be_half'])}; off tensor-core dims: "
      f"{len(report['off_tensor_core'])}; float casts: {report['num_casts']} "
      f"({report['hlo_converts']} converts in the lowered module)"
      + (f"; policy {policy}" if policy else ""))
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Memory report.
# --------------------------------------------------------------------------


def compiled_memory(compiled) -> dict[str, int]:
  """XLA's ``memory_analysis()`` of a compiled function, in bytes.

  Keys: ``argument``, ``output``, ``alias``, ``temp`` and ``peak``. Where the
  backend reports no peak, it is arguments + outputs - aliased + temporaries.
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  memory = {k: int(getattr(stats, k + "_size_in_bytes", 0)) for k in
            ("argument", "output", "alias", "temp")}
  memory["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0)) or (
      memory["argument"] + memory["output"] - memory["alias"] + memory["temp"])
  return memory


def tree_bytes(tree: Any) -> int:
  return sum(x.size * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


def activation_bytes(loss_fn: Callable[..., Any], *args) -> int:
  """Bytes the backward pass keeps from the forward pass, minus the inputs.

  These are the residuals ``jax.vjp`` saves (activations, and half copies of
  params made inside the step); arguments themselves are not counted.
  """
  from jax._src.ad_checkpoint import saved_residuals  # no public equivalent
  return sum(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
             for aval, source in saved_residuals(loss_fn, *args)
             if not source.startswith("from the argument"))


@dataclasses.dataclass
class MemoryRow:
  name: str
  params: int                 # parameters (count)
  param_bytes: int            # params + master copy
  optimizer_bytes: int        # moments, scale, counters (not the master)
  activation_bytes: int
  compiled: dict[str, int]    # XLA memory_analysis of the step
  device_peak: Optional[int]  # memory_stats()["peak_bytes_in_use"] (GPU)

  @property
  def state_bytes_per_param(self) -> float:
    return (self.param_bytes + self.optimizer_bytes) / max(self.params, 1)


def memory_row(name: str, *, params: Any, opt_state: Any,
               loss_fn: Callable[..., Any], loss_args: Sequence[Any],
               step: Optional[Callable[..., Any]] = None,
               step_args: Sequence[Any] = ()) -> MemoryRow:
  """The memory figures of one configuration (see :func:`memory_report`)."""
  from jmp_lab.optimizer import master_params
  try:
    master = master_params(opt_state)
  except ValueError:
    master = None
  master_bytes = tree_bytes(master) if master is not None else 0
  compiled, peak = {}, None
  if step is not None:
    compiled = compiled_memory(jax.jit(step).lower(*step_args).compile())
    device_stats = jax.local_devices()[0].memory_stats() or {}
    peak = device_stats.get("peak_bytes_in_use")
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params)
                 if _tree.is_floating_array(x))
  return MemoryRow(
      name=name, params=n_params,
      param_bytes=tree_bytes(params) + master_bytes,
      optimizer_bytes=tree_bytes(opt_state) - master_bytes,
      activation_bytes=activation_bytes(loss_fn, *loss_args),
      compiled=compiled, device_peak=peak)


def memory_report(rows: Sequence[MemoryRow]) -> str:
  """A table of :class:`MemoryRow` s, one per policy."""
  mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
  lines = ["| config | param+master MiB | optimizer MiB | B/param (state) "
           "| activations MiB | compiled args MiB | temp MiB | peak MiB "
           "| device peak MiB |", "|" + "---|" * 9]
  for r in rows:
    c = r.compiled
    lines.append(
        f"| {r.name} | {mib(r.param_bytes)} | {mib(r.optimizer_bytes)} | "
        f"{r.state_bytes_per_param:.1f} | {mib(r.activation_bytes)} | "
        f"{mib(c.get('argument', 0))} | {mib(c.get('temp', 0))} | "
        f"{mib(c.get('peak', 0))} | "
        f"{mib(r.device_peak) if r.device_peak else 'n/a'} |")
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Host-side recorder.
# --------------------------------------------------------------------------


class TrainingRecorder:
  """Keeps each step's metrics as device arrays; reads them afterwards.

  ``record(metrics)`` only appends references, so it never waits for the
  device; ``history()`` (or ``plot``) transfers everything at once, after
  training or whenever you choose.
  """

  KEYS = ("loss", "loss_scale", "skipped_steps", "grads_finite")

  def __init__(self, keys: Sequence[str] = KEYS):
    self.keys = tuple(keys)
    self._steps: list[dict[str, Any]] = []

  def record(self, metrics: Mapping[str, Any]) -> None:
    self._steps.append({k: metrics[k] for k in self.keys if k in metrics})

  def __len__(self) -> int:
    return len(self._steps)

  def history(self) -> dict[str, np.ndarray]:
    fetched = jax.device_get(self._steps)
    return {k: np.asarray([step[k] for step in fetched if k in step])
            for k in self.keys}

  def plot(self, path: Optional[str] = None):
    """Loss, loss scale and skipped steps against the step; returns the figure."""
    import matplotlib.pyplot as plt
    history = self.history()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(history["loss"], lw=1)
    axes[0].set(title="loss", xlabel="step", yscale="log")
    axes[1].plot(history["loss_scale"], lw=1, color="tab:orange")
    axes[1].set(title="loss scale", xlabel="step", yscale="log")
    axes[2].plot(history["skipped_steps"], lw=1, color="tab:red")
    axes[2].set(title="skipped steps (cumulative)", xlabel="step")
    fig.tight_layout()
    if path:
      fig.savefig(path, dpi=120)
    return fig
