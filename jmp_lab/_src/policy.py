"""Precision policies: which dtype params, computation and outputs use.

The implementation behind :mod:`jmp_lab.policy`, whose docstring describes it
with examples.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lab._src.matmul_modes import (  # noqa: F401  (the policy's names)
    BLOCK_SCALED_MODES, FP8_MODES, MATMUL_MODES)
from jmp_lab.kernels.pytrees import is_floating_array

T = TypeVar("T")

# The dtypes a policy may hold. fp8 is not one of them: an fp8 matmul needs a
# scale per operand, so it is the ``matmul`` key (MATMUL_MODES), not a dtype.
SUPPORTED_DTYPES = (
    np.dtype(jnp.float16),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float32),
    np.dtype(jnp.float64),
)

# Canonical name first: it is what ``str(policy)`` prints.
_DTYPE_NAMES = {
    np.dtype(jnp.float32): ("float32", "f32", "full", "single"),
    np.dtype(jnp.bfloat16): ("bfloat16", "bf16"),
    np.dtype(jnp.float16): ("float16", "f16"),
    np.dtype(jnp.float64): ("float64", "f64"),
}
_NAME_TO_DTYPE = {
    name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names
}
_ACCEPTED_DTYPE_NAMES = tuple(_NAME_TO_DTYPE) + ("half",)

_KEY_TO_FIELD = {
    "params": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
    "reduce": "reduce_dtype",
    "r": "reduce_dtype",
    "matmul": "matmul",
    "m": "matmul",
}


DTypeLike = Union[str, np.dtype, type, Any]


def half_dtype(device: jax.Device | None = None) -> np.dtype:
  """The 16-bit float that runs fastest on ``device`` (default: first device).

  The rule:

  * TPU: ``bfloat16``.
  * NVIDIA GPU of compute capability >= 8.0 (Ampere, Hopper and later):
    ``bfloat16``, which has tensor-core support and fp32's exponent range, so
    it rarely needs loss scaling.
  * Anything else (older GPUs, CPU): ``float16``.

  Note that jmp maps ``"half"`` to ``float16`` on every GPU; jmp_lab prefers
  ``bfloat16`` where the hardware supports it.
  """
  if device is None:
    device = jax.local_devices()[0]
  if device.platform == "tpu":
    return np.dtype(jnp.bfloat16)
  if device.platform == "gpu":
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) >= 8.0:
      return np.dtype(jnp.bfloat16)
  return np.dtype(jnp.float16)


def canonicalize_dtype(dtype: DTypeLike, *, what: str = "dtype") -> np.dtype:
  """Turns a dtype, a scalar type or a dtype name into a supported ``np.dtype``.

  Raises:
    ValueError: for names or dtypes that are not one of float16, bfloat16,
      float32 or float64.
  """
  if isinstance(dtype, str):
    return _parse_dtype(dtype, what=what)
  try:
    canonical = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(
        f"{what} must be a floating dtype or dtype name, got {dtype!r}; "
        f"accepted: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
    ) from e
  if canonical not in SUPPORTED_DTYPES:
    raise ValueError(
        f"{what} {canonical.name!r} is not supported; accepted: "
        f"{', '.join(d.name for d in SUPPORTED_DTYPES)}"
        + (" (fp8 needs per-tensor scaling, which policies do not do)"
           if "float8" in canonical.name else "")
    )
  return canonical


def _parse_dtype(name: str, *, what: str = "dtype") -> np.dtype:
  """Parses a dtype name such as ``"bf16"`` or ``"half"`` (see module doc)."""
  normalized = name.strip().lower()
  if normalized == "half":
    return half_dtype()
  try:
    return _NAME_TO_DTYPE[normalized]
  except KeyError:
    raise ValueError(
        f"unknown {what} {name!r}; accepted names: "
        f"{', '.join(_ACCEPTED_DTYPE_NAMES)}"
    ) from None


def cast_floating(tree: T, dtype: DTypeLike) -> T:
  """Casts every floating array leaf of ``tree`` to ``dtype``.

  Integer, boolean and PRNG-key leaves, Python scalars and non-array leaves
  pass through untouched. Leaves already in ``dtype`` are returned as-is.
  """
  dtype = np.dtype(dtype)

  def cast(x):
    # Python scalars are left alone on purpose: they are weakly typed in JAX
    # and adopt the dtype of whatever array they meet.
    if is_floating_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtype parameters, computation and outputs use.

  Dtypes may be given as dtypes, scalar types or names (``"bf16"``); they are
  stored as ``np.dtype``. Two policies are equal when their dtypes are.

  Attributes:
    param_dtype: dtype the parameters are stored in.
    compute_dtype: dtype matmuls and most activations are computed in.
    output_dtype: dtype a module's outputs are returned in.
    reduce_dtype: dtype the weight gradients of matmuls are accumulated and
      returned in, so that their sum across devices (the all-reduce or
      reduce-scatter XLA's partitioner inserts for data parallelism) runs in
      it, as torch FSDP's ``reduce_dtype``. None (the default) keeps jax's
      behaviour: a weight gradient comes out of its GEMM in the compute
      dtype and is summed across devices in it. Applied by
      :func:`jmp_lab.linen.with_policy` (see there for which modules).
    matmul: None (matmuls in the compute dtype), ``"fp8"`` or
      ``"fp8_current"``: Dense/Linear matmuls as fp8 GEMMs (E4M3 inputs and
      kernels, E5M2 output gradients) with delayed or current per-tensor
      scaling (:mod:`jmp_lab.fp8`); ``"mxfp8"`` or ``"nvfp4"``: as
      Blackwell's block-scaled GEMMs (:mod:`jmp_lab.block_scaled`).
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype
  reduce_dtype: Optional[np.dtype] = None
  matmul: Optional[str] = None

  def __post_init__(self):
    if self.matmul is not None and self.matmul not in MATMUL_MODES:
      raise ValueError(
          f"policy matmul {self.matmul!r} is not supported; accepted: "
          f"{', '.join(MATMUL_MODES)} (or None: the compute dtype)")
    for field in dataclasses.fields(self):
      if field.name == "matmul":
        continue
      if field.name == "reduce_dtype" and self.reduce_dtype is None:
        continue
      value = canonicalize_dtype(getattr(self, field.name), what=field.name)
      # Frozen dataclass: bypass __setattr__ once, at construction.
      object.__setattr__(self, field.name, value)

  def cast_to_param(self, tree: T) -> T:
    """Casts floating leaves of ``tree`` to ``param_dtype``."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts floating leaves of ``tree`` to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts floating leaves of ``tree`` to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_param_dtype(self, dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, param_dtype=dtype)

  def with_compute_dtype(self, dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, compute_dtype=dtype)

  def with_output_dtype(self, dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, output_dtype=dtype)

  def with_reduce_dtype(self, dtype: Optional[DTypeLike]) -> "Policy":
    return dataclasses.replace(self, reduce_dtype=dtype)

  def __str__(self) -> str:
    text = "params={},compute={},output={}".format(
        _DTYPE_NAMES[self.param_dtype][0],
        _DTYPE_NAMES[self.compute_dtype][0],
        _DTYPE_NAMES[self.output_dtype][0],
    )
    if self.reduce_dtype is not None:
      text += f",reduce={_DTYPE_NAMES[self.reduce_dtype][0]}"
    if self.matmul is not None:
      text += f",matmul={self.matmul}"
    return text


# A policy is configuration: static in a pytree (an optimizer state keeps the
# one it was built for), never a leaf.
jax.tree_util.register_static(Policy)


PRESETS = {
    "float32": Policy(jnp.float32, jnp.float32, jnp.float32),
    "mixed_bfloat16": Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "mixed_float16": Policy(jnp.float32, jnp.float16, jnp.float32),
    # bf16 compute with the Dense/Linear matmuls in fp8 (delayed scaling).
    "mixed_fp8": Policy(jnp.float32, jnp.bfloat16, jnp.float32, matmul="fp8"),
    # bf16 compute with the Dense/Linear matmuls block-scaled (Blackwell).
    "mixed_mxfp8": Policy(jnp.float32, jnp.bfloat16, jnp.float32,
                          matmul="mxfp8"),
    "mixed_nvfp4": Policy(jnp.float32, jnp.bfloat16, jnp.float32,
                          matmul="nvfp4"),
}


def get_policy(spec: Union[Policy, str]) -> Policy:
  """Returns the policy named or described by ``spec``.

  Args:
    spec: a :class:`Policy` (returned unchanged); a preset name
      (``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"``); a bare dtype
      name, which sets all three dtypes (``"bf16"``); or comma-separated
      ``key=dtype`` pairs with keys ``params``/``p``, ``compute``/``c``,
      ``output``/``o`` and ``reduce``/``r``, optionally after a preset
      (``"mixed_bfloat16,reduce=float32"``) or a bare dtype name
      (``"bfloat16,output=float32"``); and ``matmul``/``m`` with a
      value of :data:`MATMUL_MODES` (``"mixed_bfloat16,matmul=fp8"``, which
      is the ``"mixed_fp8"`` preset). Unset keys follow jmp: params
      defaults to float32, compute follows params, output follows compute,
      and reduce is unset (None: see :class:`Policy`). Dtype names are
      ``float32``/``f32``/``full``/``single``, ``bfloat16``/``bf16``,
      ``float16``/``f16``, ``float64``/``f64`` and ``half`` (see
      :func:`half_dtype`).

  Returns:
    The :class:`Policy`.

  Raises:
    TypeError: if ``spec`` is neither a Policy nor a string.
    ValueError: for an empty string, an unknown key, a duplicate key or an
      unknown or non-floating dtype name; the message names the bad part.

  Example::

    >>> get_policy("c=bf16")  # params f32, compute and output bf16
    Policy(param_dtype=dtype('float32'), compute_dtype=dtype(bfloat16), \
output_dtype=dtype(bfloat16), reduce_dtype=None, matmul=None)
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise TypeError(
        f"policy spec must be a Policy or a string, got {type(spec).__name__} "
        f"{spec!r}"
    )
  stripped = spec.strip()
  if not stripped:
    raise ValueError(
        "policy spec is empty; give a preset "
        f"({', '.join(PRESETS)}), a dtype name, or 'params=...,compute=...,"
        "output=...'"
    )
  if stripped in PRESETS:
    return PRESETS[stripped]
  preset, comma, rest = stripped.partition(",")
  if comma and preset.strip() in PRESETS:
    # A preset followed by keys that change it: "mixed_bfloat16,reduce=f32".
    return _parse_key_values(rest, base=PRESETS[preset.strip()], spec=spec)
  if comma and "=" not in preset:
    if preset.strip().lower() not in _ACCEPTED_DTYPE_NAMES:
      raise ValueError(_unknown_name_message(preset.strip()))
    # A bare dtype followed by keys: "bfloat16,matmul=mxfp8".
    dtype = _parse_dtype(preset.strip(), what=f"dtype in policy {spec!r}")
    return _parse_key_values(rest, base=Policy(dtype, dtype, dtype),
                             spec=spec)
  if "=" not in stripped:
    if stripped.lower() not in _ACCEPTED_DTYPE_NAMES:
      raise ValueError(_unknown_name_message(stripped))
    dtype = _parse_dtype(stripped, what=f"dtype in policy {spec!r}")
    return Policy(dtype, dtype, dtype)
  return _parse_key_values(spec)


def _unknown_name_message(name: str) -> str:
  """What a policy spec that is neither a preset nor a dtype name gets: the
  presets, the dtype names, and the closest of them."""
  candidates = list(PRESETS) + list(_ACCEPTED_DTYPE_NAMES)
  close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
  return (f"unknown dtype or preset {name!r} in policy"
          + (f": did you mean {close[0]!r}?" if close else ".")
          + f" Presets: {', '.join(PRESETS)}; a bare dtype name sets all "
          f"three dtypes ({', '.join(_ACCEPTED_DTYPE_NAMES)}); or give "
          f"'params=...,compute=...,output=...'")


def _parse_key_values(text: str, base: Optional[Policy] = None,
                      spec: Optional[str] = None) -> Policy:
  """``key=dtype`` pairs; with ``base`` (a preset) they change its fields."""
  spec = text if spec is None else spec
  chosen: dict[str, np.dtype] = {}
  for part in text.split(","):
    key, sep, value = part.partition("=")
    key = key.strip().lower()
    if not sep:
      raise ValueError(
          f"policy part {part!r} in {spec!r} is not 'key=dtype'; keys: "
          f"{', '.join(_KEY_TO_FIELD)}"
      )
    if key not in _KEY_TO_FIELD:
      raise ValueError(
          f"unknown key {key!r} in policy {spec!r}; accepted keys: "
          f"{', '.join(_KEY_TO_FIELD)}"
      )
    field = _KEY_TO_FIELD[key]
    if field in chosen:
      raise ValueError(
          f"duplicate key {key!r} in policy {spec!r}: {field} is already set"
      )
    if field == "matmul":
      chosen[field] = _parse_matmul(value, spec)
      continue
    chosen[field] = _parse_dtype(value, what=f"dtype for {key!r} in {spec!r}")
  if base is not None:
    return dataclasses.replace(base, **chosen)
  param = chosen.get("param_dtype", np.dtype(jnp.float32))
  compute = chosen.get("compute_dtype", param)
  output = chosen.get("output_dtype", compute)
  return Policy(param, compute, output, chosen.get("reduce_dtype"),
                chosen.get("matmul"))


def _parse_matmul(value: str, spec: str) -> str:
  mode = value.strip().lower()
  if mode not in MATMUL_MODES:
    raise ValueError(
        f"unknown matmul {value!r} in policy {spec!r}; accepted: "
        f"{', '.join(MATMUL_MODES)}")
  return mode


# Classes whose names end in "Norm" but are wrappers, not normalisation
# layers (flax's reparametrisations of the layer they wrap).
_NOT_NORMS = ("WeightNorm", "SpectralNorm")


def is_norm_class(cls: type) -> bool:
  """Whether a module class is a normalisation layer by its name: it ends
  in ``Norm`` (``LayerNorm``, ``RMSNorm``, ``GroupNorm``, a model's own
  ``ScaleNorm``...), flax's ``WeightNorm`` and ``SpectralNorm`` wrappers
  excepted. The front ends keep such modules in fp32 by default."""
  name = cls.__name__
  return name.endswith("Norm") and name not in _NOT_NORMS


def layer_dtype(module: Any) -> Optional[np.dtype]:
  """The floating ``dtype`` a layer sets for its own computation (flax's
  ``dtype`` attribute), or None."""
  dtype = getattr(module, "dtype", None)
  if dtype is None:
    return None
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    return None
  return dtype if jnp.issubdtype(dtype, jnp.floating) else None
