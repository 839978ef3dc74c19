"""Gradient magnitudes against the fp16 and bf16 representable ranges.

:func:`gradient_histogram` counts ``|g|`` in exact log2 buckets, per leaf and in
total; the :class:`GradientHistogram` says which share would underflow, land
in the subnormals or overflow at a loss scale, and which scales avoid both.
:func:`plot_gradient_histogram` draws it in the style of the mixed-precision
paper's activation-gradient histogram.

Example::

  >>> import jax.numpy as jnp
  >>> from jmp_lab.diagnostics import FP16, gradient_histogram
  >>> hist = gradient_histogram({"w": jnp.array([1e-9, 1e-3, 1.0, 0.0])})
  >>> hist.nonzero, hist.zeros
  (3, 1)
  >>> round(hist.share_underflowing(1.0, FP16), 3)   # 1e-9 < 2**-25
  0.333
  >>> hist.share_underflowing(2.0**15, FP16)
  0.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab.kernels import pytrees

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

# --------------------------------------------------------------------------
# Gradient-range histogram.
# --------------------------------------------------------------------------

MIN_EXPONENT, MAX_EXPONENT = -140, 130  # covers bf16/fp32 normal + subnormal


@dataclasses.dataclass
class GradientHistogram:
  """Counts of ``|g|`` in log2 buckets.

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
    """Share of nonzero finite ``|g|`` that flush to zero in ``fmt`` at the scale.

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
    """Share of nonzero finite ``|g|`` that overflow ``fmt`` at the scale."""
    limit = math.log2(fmt.max / loss_scale)
    return self._share(self.exponents >= limit - 1e-9)

  def safe_scales(self, fmt: FloatRange = FP16) -> tuple[float, float]:
    """The loss scales that keep every nonzero ``|g|`` representable in ``fmt``.

    Returns ``(low, high)``: below ``low`` the smallest gradient flushes to
    zero, above ``high`` the largest overflows. ``low > high`` means no
    single scale keeps them all.
    """
    if self.nonzero == 0:
      return (0.0, math.inf)
    return (fmt.min_subnormal / self.smallest, fmt.max / self.largest)

  def _share(self, mask: np.ndarray) -> float:
    return float(self.total[mask].sum() / max(self.nonzero, 1))

  def table(self, loss_scales: Sequence[float] = (1.0, 2.0**8, 2.0**15)
            ) -> str:
    """What each loss scale would do to these gradients in fp16 and bf16."""
    lines = [f"{self.nonzero} nonzero, {self.zeros} zero, {self.non_finite} "
             f"non-finite gradient values; ``|g|`` in [{self.smallest:.3g}, "
             f"{self.largest:.3g}]",
             f"{'format':<9} {'loss scale':>10} {'underflow %':>12} "
             f"{'subnormal %':>12} {'overflow %':>11}"]
    for fmt in (FP16, BF16):
      for scale in loss_scales:
        lines.append(
            f"{fmt.name:<9} {scale:>10g} "
            f"{100 * self.share_underflowing(scale, fmt):>12.3f} "
            f"{100 * self.share_subnormal(scale, fmt):>12.3f} "
            f"{100 * self.share_overflowing(scale, fmt):>11.3f}")
    low, high = self.safe_scales(FP16)
    lines.append(f"fp16 loss scales that keep every value: [{low:.3g}, "
                 f"{high:.3g}]" + ("  (none: the range is too wide)"
                                    if low > high else ""))
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


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
  """Log2 histogram of ``|g|`` over the floating leaves of ``grads``.

  Pass *unscaled* gradients (``loss_scale.unscale(grads)``) to ask what a
  given scale would do; pass scaled ones to see what the step saw.
  """
  per_leaf, zeros, non_finite = {}, 0, 0
  smallest, largest = math.inf, 0.0
  for path, leaf in pytrees.leaves_with_paths(grads):
    if not pytrees.is_floating_array(leaf) or leaf.size == 0:
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


__all__ = [
    "BF16",
    "FP16",
    "FloatRange",
    "gradient_histogram",
    "GradientHistogram",
    "plot_gradient_histogram",
]
