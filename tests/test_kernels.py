"""Tests for jmp_lab.kernels: flat layout, the Pallas kernel against the jnp
reference, CUDA cross-lowering of the GPU kernels, and the backend chooser."""

import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lab import _compat, kernels
from jmp_lab.kernels import layout as flat_layout
from jmp_lab.kernels import multi_tensor, pallas_triton, quantized, reference
from jmp_lab.kernels.reference import AdamWConfig

from cuda_compile import require_cuda_plugin

F32 = np.dtype(jnp.float32)


# --- layout ----------------------------------------------------------------


def test_pack_unpack_round_trip_decayed_first():
  params = {"bias": jnp.arange(3.0), "kernel": jnp.arange(6.0).reshape(2, 3) + 10,
            "step": jnp.int32(4)}
  mask = {"bias": False, "kernel": True, "step": False}
  layout = flat_layout.make_layout(params, mask, jnp.float32)
  assert layout.size == 9 and layout.decay_boundary == 6
  assert layout.padded % (flat_layout.BLOCK_ELEMENTS * layout.programs) == 0
  flat = flat_layout.pack(layout, params, jnp.float32)
  assert flat.shape == (layout.rows, flat_layout.LANES)
  chex.assert_trees_all_equal(flat.reshape(-1)[:9],
                              jnp.array([10, 11, 12, 13, 14, 15, 0, 1, 2.0]))
  chex.assert_trees_all_equal(flat.reshape(-1)[9:], jnp.zeros(layout.padded - 9))
  restored = flat_layout.unpack(layout, flat, rest=params)
  chex.assert_trees_all_equal(restored, params)
  assert flat_layout.unpack(layout, flat)["step"] is None


@pytest.mark.parametrize("size", [1, 127, 2049, 10**6 + 3, 10**9])
def test_padding_is_whole_blocks_per_program(size):
  padded = flat_layout.padded_size(size)
  programs = flat_layout.num_programs(size)
  assert padded >= size
  assert padded % (flat_layout.BLOCK_ELEMENTS * programs) == 0
  assert padded - size < flat_layout.BLOCK_ELEMENTS * programs


# --- kernel against reference ----------------------------------------------


def ulps_apart(a, b):
  """Distance in units in the last place of fp32 (0 where both are equal)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  spacing = np.spacing(np.maximum(np.abs(a), np.abs(b)))
  return np.where(a == b, 0.0, np.abs(a - b) / spacing)


# Measured on this CPU build (jax 0.10.2): with bf16 gradients the kernel and
# the reference agree bit for bit; with fp16 gradients XLA fuses the
# reference differently (it recomputes the moments inside the step's fusion,
# FMA-contracted), and >= 99.75% of master elements are within one ulp, the
# worst at 4.
MAX_ULPS = 4


def kernel_inputs(size, grad_dtype, key, poison=None):
  rows = flat_layout.padded_size(size) // flat_layout.LANES
  shape = (rows, flat_layout.LANES)
  k = jax.random.split(jax.random.key(key), 4)
  valid = (jnp.arange(rows * flat_layout.LANES) < size).reshape(shape)
  g = jnp.where(valid, jax.random.normal(k[0], shape) * 300.0, 0.0)
  if poison is not None:
    g = g.reshape(-1).at[size // 2].set(poison).reshape(shape)
  p = jnp.where(valid, jax.random.normal(k[1], shape) * 0.05, 0.0)
  mu = jnp.where(valid, jax.random.normal(k[2], shape) * 1e-3, 0.0)
  nu = jnp.where(valid, jax.random.uniform(k[3], shape) * 1e-5, 0.0)
  return g.astype(grad_dtype), p, mu, nu


def skip_unless_runnable(backend):
  """The GPU backends run only on a GPU (``JAX_PLATFORMS=cuda``)."""
  if backend in ("triton", "mosaic"):
    device = jax.devices()[0]
    if device.platform != "gpu":
      pytest.skip(f"{backend} runs on a GPU (benchmarks/gpu_run.sh runs these)")
    capability = float(getattr(device, "compute_capability", "0"))
    if capability < (9.0 if backend == "mosaic" else 8.0):
      pytest.skip(f"{backend} needs a newer GPU than {device.device_kind}")


# Worst master difference to the jitted reference, in fp32 ulps at the scale
# of its operands. Mosaic GPU lowers no sqrt and uses x * rsqrt(x) (<= 2 ulps
# of the square root), which can add a few ulps to the step.
BACKEND_MAX_ULPS = {"interpret": MAX_ULPS, "triton": MAX_ULPS, "mosaic": 2 * MAX_ULPS}


def hyper_and_flags(finite, boundary, count=7, b1=0.9, b2=0.999):
  inv1, inv2 = reference.inverse_bias_corrections(b1, b2, jnp.int32(count))
  hyper = jnp.stack([jnp.float32(3e-3), inv1, inv2, jnp.float32(256.0),
                     jnp.float32(1.0)])
  return hyper, jnp.array([int(finite), boundary], jnp.int32)


@pytest.mark.parametrize("backend", ["interpret", "triton", "mosaic"])
@pytest.mark.parametrize("size", [1, 127, 2049, 10**6 + 3])
@pytest.mark.parametrize("grad_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("keep_master", [True, False])
def test_kernel_matches_reference_within_one_ulp(size, grad_dtype, keep_master,
                                                 backend):
  skip_unless_runnable(backend)
  if size == 10**6 + 3 and not keep_master and backend == "interpret":
    pytest.skip("the large size runs once, with a master")
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01,
                       np.dtype(grad_dtype) if keep_master else None)
  g, p, mu, nu = kernel_inputs(size, grad_dtype, key=size)
  hyper, flags = hyper_and_flags(True, boundary=size // 3)
  want = jax.jit(lambda *a: reference.fused_update(config, *a))(
      g, p, mu, nu, hyper, flags)
  got = jax.jit(lambda *a: kernels.fused_update(backend, config, *a))(
      g, p, mu, nu, hyper, flags)
  for w, x in zip(want, got):
    chex.assert_type(x, w.dtype)
  # The moments agree bit for bit. The step (about seven fp32 operations) is
  # fused and FMA-contracted differently by XLA in the two programs, so a
  # few elements round up to MAX_ULPS apart; nearly all are within one ulp.
  # The master is p + step * -lr, measured at the scale of its operands.
  # The Mosaic GPU kernel's moments are within two ulps of their operands:
  # on an H200 (jax 0.11.2, the first GPU run, 2026-11-28) 1.3% of the
  # elements differed, by at most one ulp of b1 * mu, the two programs
  # contracting b1 * mu + (1 - b1) * g into an FMA differently (where the
  # two terms cancel, that is many ulps of the small result).
  # Where the terms cancel each is at most max(|old moment|, |new moment|);
  # the unfused form rounds three times, the FMA twice: two ulps of that.
  if backend == "mosaic":
    for x, w, old in ((got.mu, want.mu, mu), (got.nu, want.nu, nu)):
      x, w, old = (np.asarray(v, np.float32) for v in (x, w, old))
      scale = np.maximum(np.abs(old), np.abs(w))
      assert np.all(np.abs(x - w) <= 2 * np.spacing(scale))
  else:
    chex.assert_trees_all_equal((got.mu, got.nu), (want.mu, want.nu))
  scale = np.maximum(np.abs(np.asarray(p)), np.abs(np.asarray(want.master)))
  master_ulps = np.abs(np.asarray(got.master) - np.asarray(want.master)) / np.spacing(
      scale.astype(np.float32))
  assert master_ulps.max() <= BACKEND_MAX_ULPS[backend], master_ulps.max()
  assert np.mean(master_ulps <= 1) > 0.99
  if keep_master:  # the half copy: at most one half-precision ulp apart
    half_w, half_x = (np.asarray(v, np.float32) for v in (want.extra, got.extra))
    half_ulp = np.asarray(jnp.spacing(jnp.abs(want.extra)), np.float32)
    assert np.all(np.abs(half_w - half_x) <= half_ulp)
  elif backend == "mosaic":  # the fp32 update, at the scale of the params
    # Its moments differ from the reference's in their last bit (above), so
    # where weight decay and the Adam term cancel, the small update differs
    # by many of its own ulps (1,243 on the H200): what the params see.
    update_error = np.abs(np.asarray(got.extra) - np.asarray(want.extra))
    assert np.all(update_error <= BACKEND_MAX_ULPS[backend] * np.spacing(
        scale.astype(np.float32)))
  else:  # the fp32 update itself
    update_ulps = ulps_apart(want.extra, got.extra)  # at its own scale
    assert update_ulps.max() <= BACKEND_MAX_ULPS[backend]
    assert np.mean(update_ulps <= 1) > 0.95
  if grad_dtype == jnp.bfloat16 and backend == "interpret":  # XLA fuses alike
    chex.assert_trees_all_equal(got, want)
  # Something really happened: weights moved, decayed and undecayed alike.
  assert float(jnp.max(jnp.abs(got.master - p))) > 0


@pytest.mark.parametrize("poison", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("backend_fn", ["reference", "interpret", "triton", "mosaic"])
def test_non_finite_flag_writes_nothing_new(poison, backend_fn):
  skip_unless_runnable(backend_fn)
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16))
  g, p, mu, nu = kernel_inputs(5000, jnp.bfloat16, key=1, poison=poison)
  hyper, flags = hyper_and_flags(False, boundary=100)
  out = kernels.fused_update(backend_fn, config, g, p, mu, nu, hyper, flags)
  chex.assert_trees_all_equal((out.master, out.mu, out.nu), (p, mu, nu))
  chex.assert_trees_all_equal(out.extra, p.astype(jnp.bfloat16))


def test_padding_stays_zero():
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.float16))
  g, p, mu, nu = kernel_inputs(127, jnp.float16, key=2)
  hyper, flags = hyper_and_flags(True, boundary=127)
  out = kernels.fused_update("interpret", config, g, p, mu, nu, hyper, flags)
  chex.assert_trees_all_equal(out.master.reshape(-1)[127:],
                              jnp.zeros(out.master.size - 127))


# --- the GPU kernels lower for CUDA on a CPU-only machine -------------------


def lowered_for_cuda(fn, *args):
  # Under an abstract H100: jax 0.12's Pallas Triton lowering asks which GPU.
  with _compat.lowering_for(_compat.abstract_gpu()):
    return jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("keep_master", [True, False])
def test_triton_kernel_lowers_for_cuda_with_in_place_aliases(keep_master):
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01,
                       np.dtype(jnp.bfloat16) if keep_master else None)
  args = kernel_inputs(3000, jnp.bfloat16, key=3) + hyper_and_flags(True, 10)
  text = lowered_for_cuda(
      lambda *a: pallas_triton.fused_update(config, *a, interpret=False), *args)
  assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text
  assert "output_operand_aliases" in text


@pytest.mark.parametrize("keep_master", [True, False])
def test_mosaic_kernel_lowers_for_cuda(keep_master):
  from jmp_lab.kernels import mosaic
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01,
                       np.dtype(jnp.bfloat16) if keep_master else None)
  args = kernel_inputs(300_000, jnp.bfloat16, key=4) + hyper_and_flags(True, 10)
  text = lowered_for_cuda(lambda *a: mosaic.fused_update(config, *a), *args)
  assert "mosaic_gpu" in text


def _quantized_rows(x, kind, second):
  """A flat buffer's moment stored 8-bit, a row a block, as fused_adamw's
  flat layout keeps it."""
  return quantized.store(quantized.blocked(x, flat_layout.LANES), kind, second)


def _mosaic_run():
  """On a Hopper GPU the compiled kernel; elsewhere Pallas' Mosaic GPU
  interpreter on the CPU (the same steps; see ``mosaic.fused_update``)."""
  device = jax.devices()[0]
  compiled = (device.platform == "gpu"
              and float(getattr(device, "compute_capability", "0")) >= 9.0)
  return {"interpret": not compiled}


def _bits(x) -> np.ndarray:
  """An array's bit patterns (0.0 and -0.0 differ, a NaN equals itself)."""
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _codes_apart(x, w, kind) -> np.ndarray:
  """How many code steps apart two 8-bit moments' codes are, element by
  element (fp8: neighbouring magnitudes are neighbouring bit patterns)."""
  if kind == "int8":
    return np.abs(np.asarray(x).astype(np.int32) - np.asarray(w).astype(np.int32))
  magnitude = lambda c: (_bits(c) & 0x7F).astype(np.int32)  # noqa: E731
  sign = lambda c: _bits(c) >> 7  # noqa: E731
  return np.where(sign(x) == sign(w), np.abs(magnitude(x) - magnitude(w)),
                  magnitude(x) + magnitude(w))


@pytest.mark.parametrize("mu_kind, nu_kind, max_programs", [
    ("int8", "int8", None), ("float8_e4m3fn", "float8_e4m3fn", None),
    ("int8", None, None), (None, None, None),
    # Five programs of seven steps each: every program's later blocks.
    ("int8", "float8_e4m3fn", 5)])
@pytest.mark.parametrize("finite", [True, False])
def test_mosaic_kernel_quantizes_a_row_a_block_as_the_reference(
    mu_kind, nu_kind, max_programs, finite, monkeypatch):
  """The Mosaic GPU flat kernel with 8-bit moments (and, ``None``, the fp32
  moments of its first version) against the reference: the codes as the
  reference's but where a scale differs in its last bit, scales and master
  within the Mosaic kernel's ulps; a skipped step leaves every array bit for
  bit. On the CPU this is Pallas' Mosaic GPU interpreter (the kernel's
  steps in a loop; see ``mosaic.fused_update``). Before this kernel
  ``backend="mosaic"`` refused 8-bit moments."""
  from jmp_lab.kernels import mosaic  # pylint: disable=import-outside-toplevel
  if max_programs is not None:
    monkeypatch.setattr(flat_layout, "MAX_PROGRAMS", max_programs)
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16),
                       mu_quant=mu_kind, nu_quant=nu_kind)
  size = 70_000
  g, p, mu, nu = kernel_inputs(size, jnp.bfloat16, key=11)
  if max_programs is not None:
    assert g.shape[0] // flat_layout.BLOCK_ROWS == 7 * max_programs
  mu = mu if mu_kind is None else _quantized_rows(mu, mu_kind, False)
  nu = nu if nu_kind is None else _quantized_rows(nu, nu_kind, True)
  hyper, flags = hyper_and_flags(finite, boundary=30_000)
  want = jax.jit(lambda *a: reference.fused_update(config, *a))(
      g, p, mu, nu, hyper, flags)
  got = mosaic.fused_update(config, g, p, mu, nu, hyper, flags, **_mosaic_run())
  chex.assert_trees_all_equal_structs(got, want)
  chex.assert_trees_all_equal_dtypes(got, want)
  if not finite:
    for x, old in zip(jax.tree_util.tree_leaves((got.master, got.mu, got.nu,
                                                 got.extra)),
                      jax.tree_util.tree_leaves((p, mu, nu,
                                                 p.astype(jnp.bfloat16)))):
      np.testing.assert_array_equal(_bits(x), _bits(old))
    return
  # As the fp32 kernel's moments: within two ulps of their operands (the
  # old moment), where b1 * mu + (1 - b1) * g is contracted differently.
  for x, w, old, kind in ((got.mu, want.mu, mu, mu_kind),
                          (got.nu, want.nu, nu, nu_kind)):
    if kind is None:
      x, w, old = (np.asarray(v) for v in (x, w, old))
      assert np.all(np.abs(x - w) <= 2 * np.spacing(np.maximum(np.abs(old),
                                                                np.abs(w))))
      continue
    # A code may round the other way where its scale differs in the last
    # bit: measured, 1 code of 71,680 (int8), none (fp8).
    apart = _codes_apart(x.codes, w.codes, kind)
    assert np.count_nonzero(apart) <= 8 and apart.max() <= 1, apart.max()
    scales_x, scales_w, scales_old = (np.asarray(v.scales)
                                      for v in (x, w, old))
    # A second moment's scale is a square root: its two ulps, plus those of
    # Mosaic's x * rsqrt(x) (at most two more).
    assert np.all(np.abs(scales_x - scales_w) <= 4 * np.spacing(
        np.maximum(scales_old, scales_w)))
    assert float(np.min(scales_x[: size // flat_layout.LANES])) > 0
  scale = np.maximum(np.abs(np.asarray(p)), np.abs(np.asarray(want.master)))
  master_ulps = np.abs(np.asarray(got.master) - np.asarray(want.master)) / np.spacing(scale)
  assert master_ulps.max() <= BACKEND_MAX_ULPS["mosaic"], master_ulps.max()
  assert float(jnp.max(jnp.abs(got.master - p))) > 0


def test_mosaic_kernel_names_a_moment_its_config_does_not_match():
  from jmp_lab.kernels import mosaic  # pylint: disable=import-outside-toplevel
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.0, np.dtype(jnp.bfloat16))
  g, p, mu, nu = kernel_inputs(2048, jnp.bfloat16, key=1)
  with pytest.raises(ValueError, match="mu is an 8-bit moment but "
                     "config.mu_quant is None"):
    mosaic.fused_update(config, g, p, _quantized_rows(mu, "int8", False), nu,
                        *hyper_and_flags(True, 0), interpret=True)


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3fn"])
def test_mosaic_kernel_with_8_bit_moments_compiles_for_sm90a_without_spills(kind):
  """Compiled for the H100: no register spills (``compiled_report`` fails on
  one), and the kernel moves what the update needs: g, p, both moments' codes
  and scales read, p, codes, scales and the bf16 copy written."""
  require_cuda_plugin()
  from jmp_lab.diagnostics import compiled_report  # pylint: disable=import-outside-toplevel
  from jmp_lab.kernels import mosaic  # pylint: disable=import-outside-toplevel
  rows = 132 * 8 * 4
  config = AdamWConfig(0.9, 0.999, 1e-8, 1e-4, np.dtype(jnp.bfloat16),
                       mu_quant=kind, nu_quant=kind)
  moment = lambda second: quantized.QuantizedMoment(  # noqa: E731
      jax.ShapeDtypeStruct((rows, 256), quantized.zeros(
          (1, 256), kind, second).codes.dtype),
      jax.ShapeDtypeStruct((rows, 1), jnp.float32))
  args = (jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16),
          jax.ShapeDtypeStruct((rows, 256), jnp.float32), moment(False),
          moment(True), jax.ShapeDtypeStruct((5,), jnp.float32),
          jax.ShapeDtypeStruct((2,), jnp.int32))
  report = compiled_report(lambda *a: mosaic.fused_update(config, *a), *args,
                           donate_argnums=(1, 2, 3), fail_on_spill=True)
  (kernel,) = report.pallas_kernels
  assert kernel.backend == "mosaic" and kernel.spill_bytes == 0
  elements = rows * 256
  # g 2 + p 4 + codes 2 + scales read; p 4 + codes 2 + scales + bf16 2 written
  ideal = elements * 16 + 4 * rows * 4
  assert ideal <= report.custom_call_bytes <= 1.01 * ideal


def test_mosaic_sqrt_keeps_zero_and_is_close():
  from jmp_lab.kernels import mosaic
  x = jnp.array([0.0, 1e-12, 2.0, 1e8])
  got = mosaic.sqrt_via_rsqrt(x)
  assert float(got[0]) == 0.0
  assert ulps_apart(got, jnp.sqrt(x)).max() <= 2


# --- chooser ---------------------------------------------------------------


def test_auto_uses_the_reference_when_compiled_for_cpu(caplog):
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16))
  args = kernel_inputs(3000, jnp.bfloat16, key=5) + hyper_and_flags(True, 10)
  with caplog.at_level(logging.INFO, logger="jmp_lab"):
    got = jax.jit(lambda *a: kernels.fused_update("auto", config, *a))(*args)
  assert "reference elsewhere" in caplog.text
  chex.assert_trees_all_equal(
      got, jax.jit(lambda *a: reference.fused_update(config, *a))(*args))
  # Lowered for the CPU whatever the default backend (on a GPU machine the
  # default is CUDA, where "auto" takes the kernel: found on the first run).
  text = jax.jit(lambda *a: kernels.fused_update("auto", config, *a)).trace(
      *args).lower(lowering_platforms=("cpu",)).as_text()
  assert "pallas" not in text and "triton" not in text


def test_auto_puts_the_pallas_kernel_in_a_step_lowered_for_cuda():
  """Decided by the platform being compiled for, not by the local device."""
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16))
  args = kernel_inputs(3000, jnp.bfloat16, key=6) + hyper_and_flags(True, 10)
  text = lowered_for_cuda(lambda *a: kernels.fused_update("auto", config, *a), *args)
  assert kernels.cuda_backend() == "triton"
  assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_explicit_gpu_backends_are_accepted_without_a_gpu(backend):
  """So that a step with them can be compiled for an H100 on a CPU machine."""
  assert kernels.resolve_backend(backend) == backend
  assert backend in kernels.available_backends()


# --- jax 0.11 drift, checked on 0.10 -----------------------------------------


@pytest.fixture
def triton_hidden(monkeypatch):
  """A jax whose ``jax.experimental.pallas.triton`` cannot be imported (as
  when upstream removes the deprecated backend)."""
  from jmp_lab.kernels import platform
  real = platform.importable
  monkeypatch.setattr(platform, "importable",
                      lambda module: False if "triton" in module
                      else real(module))


def test_without_triton_auto_falls_back_mosaic_flat_and_xla_tree(
    triton_hidden):
  assert "triton" not in kernels.available_backends()
  assert kernels.cuda_backend() == "mosaic"
  assert kernels.registry.for_cuda("tree") == "reference"
  with pytest.raises(ValueError, match="'triton' needs "
                     "jax.experimental.pallas.triton"):
    kernels.resolve_backend("triton")
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16))
  flat = kernel_inputs(300_000, jnp.bfloat16, key=6) + hyper_and_flags(True, 10)
  text = lowered_for_cuda(lambda *a: kernels.fused_update("auto", config, *a),
                          *flat)
  assert "mosaic_gpu" in text and "triton" not in text
  leaves = [kernel_inputs(3000, jnp.bfloat16, key=k) for k in (7, 8)]
  tree = [list(x) for x in zip(*leaves)] + list(hyper_and_flags(True, 10))
  text = lowered_for_cuda(lambda g, p, mu, nu, hyper, flags: kernels.tree_update(
      "auto", config, [True, True], g, p, mu, nu, hyper, flags,
      write_extra=True), *tree)
  assert "triton" not in text and "mosaic" not in text


def test_the_mosaic_kernel_pins_the_lane_lowering_it_was_written_for():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jmp_lab.kernels import mosaic
  assert (mosaic.COMPILER_PARAMS.lowering_semantics
          is plgpu.LoweringSemantics.Lane)
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16))
  args = kernel_inputs(300_000, jnp.bfloat16, key=4) + hyper_and_flags(True, 10)
  calls = []
  real = plgpu.kernel

  def spy(*a, **k):
    calls.append(k.get("compiler_params"))
    return real(*a, **k)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(plgpu, "kernel", spy)
    lowered_for_cuda(lambda *a: mosaic.fused_update(config, *a), *args)
  assert calls == [mosaic.COMPILER_PARAMS]


@pytest.mark.parametrize("needs_index", [True, False])
def test_mosaic_load_gives_an_index_only_where_jax_needs_one(needs_index):
  """jax 0.10 requires plgpu.load's index, jax 0.11 deprecates it: the
  compat module reads which from the installed ``plgpu.load``."""
  from jmp_lab import _compat
  seen = []

  class Plgpu:  # plgpu.load as each jax version declares it
    if needs_index:
      @staticmethod
      def load(ref, idx, *, layout=None, optimized=True):
        seen.append((idx,))
        return ref
    else:
      @staticmethod
      def load(ref, idx=None, *, layout=None, optimized=True):
        seen.append(() if idx is None else (idx,))
        return ref

  assert _compat.mosaic_load(Plgpu, "ref", layout=None) == "ref"
  assert seen == [((),) if needs_index else ()]


def test_jax_011s_triton_deprecation_is_quiet_once_jmp_lab_builds_triton():
  import warnings
  kernels.platform.quiet_triton_deprecation.cache_clear()
  message = ("The Pallas Triton backend is deprecated and will be removed in a "
             "future JAX version.")
  with warnings.catch_warnings(record=True) as before:
    warnings.simplefilter("always")
    kernels.platform.quiet_triton_deprecation()
    warnings.warn(message, DeprecationWarning)
    warnings.warn("another deprecation", DeprecationWarning)
  assert [str(w.message) for w in before] == ["another deprecation"]
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01, np.dtype(jnp.bfloat16))
  kernels.platform.quiet_triton_deprecation.cache_clear()
  args = kernel_inputs(3000, jnp.bfloat16, key=6) + hyper_and_flags(True, 10)
  lowered_for_cuda(lambda *a: kernels.fused_update("triton", config, *a),
                   *args)
  assert kernels.platform.quiet_triton_deprecation.cache_info().currsize == 1


def test_unknown_backend_raises():
  with pytest.raises(ValueError, match="unknown fused backend 'cuda'.*mosaic"):
    kernels.resolve_backend("cuda")


# --- the multi-tensor kernels (layout="tree") ---------------------------------


@pytest.mark.parametrize("poison_at", [None, 5 * 2048 + 7, 9000])
def test_multi_tensor_statistics_span_several_programs_per_leaf(monkeypatch,
                                                                poison_at):
  """Each statistics program sums STATS_BLOCKS blocks (2 here): leaves of
  several programs, a last program past the leaf's end, a leaf smaller than
  one block; an inf in a later program of the first leaf, or in the last,
  partial block of the third, clears the flag."""
  monkeypatch.setattr(multi_tensor, "STATS_BLOCKS", 2)
  sizes = [6 * 2048 + 5, 3, 9001]
  g = [jax.random.normal(jax.random.key(i), (n,)).astype(jnp.bfloat16) * 64
       for i, n in enumerate(sizes)]
  if poison_at is not None:
    leaf = 0 if poison_at < sizes[0] else 2
    g[leaf] = g[leaf].at[poison_at].set(jnp.inf)
  want = kernels.tree_grad_stats("reference", g, jnp.float32(8.0))
  got = jax.jit(lambda g: kernels.tree_grad_stats("interpret", g,
                                                  jnp.float32(8.0)))(g)
  assert bool(got[1]) == bool(want[1]) == (poison_at is None)
  if poison_at is None:
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)


@pytest.mark.parametrize("backend", ["interpret", "triton"])
@pytest.mark.parametrize("mode", ["fp32-master", "fp32-params", "remainder",
                                  "none-nearest", "none-stochastic"])
@pytest.mark.parametrize("finite", [True, False])
def test_multi_tensor_kernels_match_the_reference(backend, mode, finite,
                                                  monkeypatch):
  """Leaves of uneven size (partial last blocks), 4 a launch (two launches):
  the moments within an fp32 ulp (XLA contracts ``(1 - b1) * g + b1 * m``
  into an FMA in one program and not the other), the master within a few
  ulps (with no master, the half params within a half ulp: the same but for
  that fp32 ulp before rounding), the statistics to fp32 rounding, and a
  non-finite step changes nothing."""
  skip_unless_runnable(backend)
  keep_master = mode != "fp32-params"
  direct = mode.startswith("none")
  config = AdamWConfig(0.9, 0.999, 1e-8, 0.01,
                       np.dtype(jnp.bfloat16) if keep_master else None,
                       remainder=mode == "remainder", direct=direct,
                       stochastic=mode == "none-stochastic")
  monkeypatch.setattr(multi_tensor, "LEAVES_PER_LAUNCH", 4)
  sizes = [1, 127, 2049, 300, 397, 4099]
  leaves = [[x.reshape(-1)[:n] for x in kernel_inputs(n, jnp.bfloat16, key=i)]
            for i, n in enumerate(sizes)]
  g, p, mu, nu = (list(x) for x in zip(*leaves))
  if mode == "remainder":
    from jmp_lab import remainder
    p, remainders = (list(x) for x in zip(*[remainder.split(remainder.untie(x))
                                            for x in p]))
  else:
    remainders = None
  if direct:
    p = [x.astype(jnp.bfloat16) for x in p]
  decays = [i % 3 != 0 for i in range(len(sizes))]
  hyper, flags = hyper_and_flags(finite, boundary=0)
  flags = jnp.append(flags, jnp.int32(-123456789))  # the rounding seed
  run = lambda b: jax.jit(lambda *a: kernels.tree_update(  # noqa: E731
      b, config, decays, *a, write_extra=True, remainders=remainders))(
          g, p, mu, nu, hyper, flags)
  want, got = run("reference"), run(backend)
  chex.assert_trees_all_close((got.mu, got.nu), (want.mu, want.nu),
                              rtol=2.5e-7, atol=0)
  if not finite:
    chex.assert_trees_all_equal(got, want)
    return
  if direct:
    w, x = (np.concatenate([np.asarray(v, np.float32) for v in out.master])
            for out in (want, got))
    assert np.mean(w == x) > 0.99
    np.testing.assert_array_less(np.abs(x - w), 1.01 * np.spacing(
        np.abs(w).astype(jnp.bfloat16)).astype(np.float32) + 1e-30)
  elif mode != "remainder":  # (remainders are the master's low bits)
    # As the flat kernel: XLA fuses and FMA-contracts the step differently
    # in the two programs; over these leaves a few elements land up to
    # twice MAX_ULPS apart, and 99% within one ulp.
    old = np.concatenate([np.asarray(x, np.float32) for x in p])
    w, x = (np.concatenate([np.asarray(v) for v in out.master])
            for out in (want, got))
    scale = np.maximum(np.abs(old), np.abs(w)).astype(np.float32)
    ulps = np.abs(x - w) / np.spacing(scale)
    assert ulps.max() <= 2 * BACKEND_MAX_ULPS[backend], ulps.max()
    assert np.mean(ulps <= 1) > 0.99
  want_stats = kernels.tree_grad_stats("reference", g, jnp.float32(256.0))
  got_stats = kernels.tree_grad_stats(backend, g, jnp.float32(256.0))
  assert bool(got_stats[1]) == bool(want_stats[1])
  np.testing.assert_allclose(float(got_stats[0]), float(want_stats[0]), rtol=1e-5)


# --- the fp8 cast-transpose kernel --------------------------------------------


from jmp_lab.kernels import cast_transpose  # noqa: E402


def _xla_quantized(x, scale, dtype):
  """XLA's quantization as the GPU compiles it: fp32 division, clipped."""
  fp8_max = float(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -fp8_max,
                  fp8_max).astype(dtype)


@pytest.mark.parametrize("shape,programs", [
    ((64, 128), 2), ((256, 96), 4), ((256, 768), 64), ((96, 64), 3)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fp8", [jnp.float8_e5m2, jnp.float8_e4m3fn])
@pytest.mark.parametrize("implementation", ["interpret", "triton"])
def test_cast_transpose_kernel_equals_xla_quantization(shape, programs, dtype,
                                                       fp8, implementation):
  """Both layouts bit for bit as XLA quantizes (values past the format's
  largest are clipped to it), and partial maxima whose maximum is the
  amax: in interpret mode, and on a GPU (the GPU script's kernels part)."""
  if implementation == "triton" and jax.devices()[0].platform != "gpu":
    pytest.skip("the Triton kernel runs on a GPU")
  key = jax.random.PRNGKey(shape[0] + shape[1])
  x = (jax.random.normal(key, shape) * 64).astype(dtype)
  x = x.at[3, 5].set(jnp.asarray(-60000.0 if dtype == jnp.float16 else 1e6,
                                 dtype))  # saturates
  scale = jnp.float32(0.37)
  lay = cast_transpose.tiling(shape, programs)
  assert lay is not None and lay.programs == programs
  q, q_t, maxima = cast_transpose.cast_transpose(
      x, scale, fp8, lay, interpret=implementation == "interpret")
  expected = _xla_quantized(x, scale, fp8)
  chex.assert_type([q, q_t], fp8)
  chex.assert_shape(q_t, shape[::-1])
  np.testing.assert_array_equal(np.asarray(q, np.float32),
                                np.asarray(expected, np.float32))
  np.testing.assert_array_equal(np.asarray(q_t, np.float32),
                                np.asarray(expected, np.float32).T)
  chex.assert_shape(maxima, (programs,))
  assert float(maxima.max()) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
  assert float(jnp.abs(q.astype(jnp.float32)).max()) == float(
      jnp.finfo(fp8).max)


@pytest.mark.parametrize("shape,programs,strips", [
    ((256, 256), 4, True), ((96, 64), 3, True), ((256, 768), 64, False),
    ((256, 768), 8, False)])
@pytest.mark.parametrize("implementation", ["interpret", "triton"])
def test_cast_transpose_kernel_sums_the_columns(shape, programs, strips,
                                                implementation):
  """With column sums (a Dense layer's bias gradient), the same fp8
  tensors and maxima, and partial sums whose sum over rows is each
  column's sum in fp32: by column strips where each program's tiles share
  their columns, else a row of sums for each tile."""
  if implementation == "triton" and jax.devices()[0].platform != "gpu":
    pytest.skip("the Triton kernel runs on a GPU")
  x = (jax.random.normal(jax.random.PRNGKey(7), shape) * 4).astype(
      jnp.bfloat16)
  scale = jnp.float32(0.25)
  lay = cast_transpose.tiling(shape, programs, column_sums=True)
  assert lay.strips == strips and lay.programs == programs
  plain = cast_transpose.cast_transpose(
      x, scale, jnp.float8_e5m2, cast_transpose.tiling(shape, programs),
      interpret=implementation == "interpret")
  q, q_t, maxima, sums = cast_transpose.cast_transpose(
      x, scale, jnp.float8_e5m2, lay, interpret=implementation == "interpret")
  chex.assert_trees_all_equal((q, q_t), plain[:2])
  assert float(maxima.max()) == float(plain[2].max())
  chex.assert_shape(sums, (lay.sum_rows(shape[0]), shape[1]))
  chex.assert_type(sums, jnp.float32)
  np.testing.assert_allclose(
      np.asarray(sums).sum(axis=0),
      np.asarray(x, np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)


def test_cast_transpose_layout_tiles_over_exactly_the_programs_or_none():
  lay = cast_transpose.tiling((8192, 2048), 1024)
  assert (8192 // lay.tile_rows) * (2048 // lay.tile_cols) == (
      lay.tiles_per_program * 1024)
  assert cast_transpose.tiling((100, 768), 1024) is None   # ragged rows
  assert cast_transpose.tiling((64, 64), 1024) is None     # too few tiles
  assert cast_transpose.tiling((64, 64, 2), 4) is None     # not 2-D


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="XLA's path is what runs off CUDA; on a GPU the "
                    "kernel runs, tested against it below")
def test_quantize_transpose_off_cuda_is_xla_quantization_and_its_parts():
  x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128).astype(
      jnp.bfloat16)
  quantize = lambda x, s: _xla_quantized(x, s, jnp.float8_e5m2)  # noqa: E731
  q, q_t, maxima = jax.jit(
      lambda x: cast_transpose.quantize_transpose(
          x, jnp.float32(2.0), jnp.float8_e5m2, 4, quantize))(x)
  chex.assert_trees_all_equal(q, quantize(x, 2.0))
  chex.assert_trees_all_equal(q_t, quantize(x, 2.0).T)
  np.testing.assert_array_equal(
      maxima, np.abs(np.asarray(x, np.float32)).reshape(4, -1).max(axis=1))
  *_, sums = cast_transpose.quantize_transpose(
      x, jnp.float32(2.0), jnp.float8_e5m2, 4, quantize, column_sums=True)
  np.testing.assert_array_equal(sums, np.asarray(x, np.float32).sum(axis=0))


def _cast_transpose_lowered_for_cuda():
  x = jnp.ones((1024, 1024), jnp.bfloat16)
  quantize = lambda x, s: _xla_quantized(x, s, jnp.float8_e5m2)  # noqa: E731
  return lowered_for_cuda(lambda x: cast_transpose.quantize_transpose(
      x, jnp.float32(2.0), jnp.float8_e5m2, 1024, quantize), x)


def _has_triton_call(text):
  return "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text


def test_quantize_transpose_for_cuda_is_the_triton_kernel():
  assert _has_triton_call(_cast_transpose_lowered_for_cuda())


def test_without_triton_quantize_transpose_takes_xlas_path(triton_hidden):
  """Once jax removes Pallas' Triton backend (deprecated in 0.11), fp8's
  output gradients are quantized and transposed by XLA: the step still
  lowers for CUDA (before: an ImportError at the lowering)."""
  text = _cast_transpose_lowered_for_cuda()
  assert not _has_triton_call(text) and "fp8_cast_transpose" not in text


@pytest.mark.parametrize("shape", [(16, 4), (0, 8), (3, 5)])
def test_quantize_transpose_of_a_tensor_smaller_than_the_programs(shape):
  """Fewer (or not a multiple of) elements than maxima slots: each slot
  holds the amax (a shape an NNX Linear's 16 x 4 gradient has)."""
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape).astype(
      jnp.bfloat16) - 7
  quantize = lambda x, s: _xla_quantized(x, s, jnp.float8_e4m3fn)  # noqa: E731
  q, q_t, maxima = cast_transpose.quantize_transpose(
      x, jnp.float32(1.0), jnp.float8_e4m3fn, 1024, quantize)
  chex.assert_shape([q, q_t.T], shape)
  amax = float(jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0))
  np.testing.assert_array_equal(maxima, np.full(1024, amax, np.float32))


@pytest.mark.parametrize("shape,column_sums", [
    ((8192, 3072), False), ((8192, 3072), True), ((8192, 2048), True)])
def test_cast_transpose_compiles_for_the_h100_as_one_kernel_without_spills(
    shape, column_sums):
  """One Triton kernel reads the 16-bit tensor once and writes both fp8
  layouts: 4 bytes an element (XLA's quantize-then-transpose moves 5), and
  with the column sums (a bias gradient) their partial sums more: a row a
  tile where 3 tiles a program cross strips (3,072 columns), a row a strip
  where 4 do not (2,048). The tiles with sums are smaller (64 x 64): at
  64 x 128 the sums took 168 registers a thread, half the resident warps."""
  require_cuda_plugin()
  from jmp_lab.diagnostics import compiled_report
  lay = cast_transpose.tiling(shape, 1024, column_sums)
  report = compiled_report(
      lambda x, s: cast_transpose.cast_transpose(x, s, jnp.float8_e5m2, lay),
      jax.ShapeDtypeStruct(shape, jnp.bfloat16),
      jax.ShapeDtypeStruct((), jnp.float32))
  assert report.kernels == 1
  [kernel] = report.pallas_kernels
  assert kernel.backend == "triton" and kernel.spill_bytes == 0, kernel
  assert kernel.registers <= 128, kernel
  sums = 4 * lay.sum_rows(shape[0]) * shape[1] if column_sums else 0
  assert lay.strips == (shape[1] == 2048)
  assert report.bytes_accessed == pytest.approx(4 * shape[0] * shape[1] + sums,
                                                rel=1e-3)
