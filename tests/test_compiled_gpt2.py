"""GPT-2-small, every configuration of the benchmark, compiled for an H100.

Split from test_compiled.py so that the two files, the slowest in the suite,
run in parallel (the README's command runs a file per pytest-xdist process);
each configuration is compiled once per process (``gpt2_report``).
"""

import functools
import pathlib
import re
import sys

import pytest

import jmp_lab

#: Every test here compiles GPT-2's step for an H100 (see tests/conftest.py).
pytestmark = pytest.mark.model_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import train_step  # noqa: E402


# --- GPT-2-small, every configuration of the benchmark ------------------------


def gpt2_report(name: str, layers: int = 12):
  """The GPT-2-small step of a benchmark config (or its first ``layers``
  layers), compiled for an H100 once per test session (each compile of the
  whole model takes 10-40 s)."""
  return _compiled(name, layers)  # one cache key, however it is called


@functools.lru_cache(maxsize=None)
def _compiled(name: str, layers: int):
  config = next(c for c in train_step.ALL_CONFIGS
                if c.name == name)
  return train_step.compiled_step_report(
      config, train_step.ModelSize(layers=layers), "h100")


def kernel_expected(config) -> bool:
  """``fused_adamw(backend="auto")`` puts the multi-tensor kernel in the step
  only with half params (a separate fp32 master); with fp32 params it keeps
  XLA's per-leaf fusion, which moves fewer bytes there."""
  return config.fused and jmp_lab.get_policy(config.policy).param_dtype.itemsize == 2


# fp16+fused compiles the very step fp16 does: with fp32 params
# fused_adamw(backend="auto") keeps XLA's path (asserted for bf16+fused below).
GPT2_CONFIGS = [c for c in train_step.CONFIGS if c.name != "fp16+fused"]


# Only bf16-o2 and its fused twin (issue 12's headline: bytes, B/param and
# kernels of the update) are compiled whole in CI; the other configs are
# checked on 1 of GPT-2-small's 12 layers (the same layer, so the same
# GEMMs and leaves): what is asserted of them (GEMM math; fused auto equal
# to XLA's path with fp32 params) does not depend on the depth, and CI time
# is short. The whole model's figures for every config are in
# benchmarks/RESULTS.md.
SHALLOW = {"fp32-highest": 1, "fp32-tf32": 1, "fp16": 1, "bf16": 1,
           "bf16+fused": 1}


@pytest.mark.parametrize("config", GPT2_CONFIGS, ids=lambda c: c.name)
def test_gpt2_small_step_compiles_for_h100(config):
  layers = SHALLOW.get(config.name, 12)
  report = gpt2_report(config.name, layers)
  policy = jmp_lab.get_policy(config.policy)
  assert report.memory["temp"] > 0 and report.kernels > 100
  assert len(report.gemms) >= layers * 6  # every layer's projections, fwd and bwd
  if policy.compute_dtype.itemsize == 2:
    assert report.fp32_gemms == [], [g.operands for g in report.fp32_gemms]
    assert report.gemm_flop_share("16-bit") == 1.0
  else:
    expected = "fp32" if config.precision == "highest" else "tf32"
    assert report.gemm_flop_share(expected) == 1.0
  pallas = report.pallas_kernels
  assert {k.backend for k in pallas} == ({"triton"} if kernel_expected(config)
                                         else set())
  assert all(k.spill_bytes == 0 for k in pallas)  # XLA's kernels: fail_on_spill


# --- issue 12: the fused update against XLA's own fusion ---------------------

HOST_SYNC = re.compile(r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(|"
                       r"callback")


@pytest.mark.parametrize("unfused,fused", [("bf16-o2", "bf16-o2+fused"),
                                           ("bf16", "bf16+fused")])
def test_fused_auto_beats_or_equals_xla_on_the_gpt2_step(unfused, fused):
  """The goal of issue 12, on the step compiled for an H100.

  bf16-o2 (half params, fp32 master): the multi-tensor kernel moves fewer
  bytes than XLA's fusion of mixed_precision(adamw), at most 30 B/param in
  its update, in far fewer kernels, with no spills and no host sync. With
  fp32 params (mixed_bfloat16) the kernel cannot win, and "auto" compiles
  XLA's path: the same bytes as unfused.
  """
  layers = SHALLOW.get(unfused, 12)
  size = train_step.ModelSize(layers=layers)
  params = train_step.param_count(size)
  base, got = gpt2_report(unfused, layers), gpt2_report(fused, layers)
  base_update = base.scope(jmp_lab.training.UPDATE_SCOPE)
  update = got.scope(jmp_lab.training.UPDATE_SCOPE)
  print(f"{fused}: {got.bytes_accessed / 1e9:.2f} GB/step, update "
        f"{update['kernels']} kernels ({update['host_launches']} host "
        f"launches), {update['io_bytes'] / params:.2f} B/param; "
        f"{unfused}: {base.bytes_accessed / 1e9:.2f} GB/step, update "
        f"{base_update['kernels']} kernels ({base_update['host_launches']} "
        f"host launches), {base_update['io_bytes'] / params:.2f} B/param")
  assert not HOST_SYNC.search(got.hlo_text)
  assert all(k.spill_bytes == 0 for k in got.pallas_kernels)
  if fused == "bf16-o2+fused":
    # Measured: 71.2 against 71.4 GB; 30.0 against 32.0 B/param; 30
    # against 428 kernels (16 leaves a launch: 13 launches of each kernel,
    # and 4 scalar kernels).
    assert got.bytes_accessed < base.bytes_accessed
    assert update["io_bytes"] / params <= 30.05
    assert update["kernels"] * 10 < base_update["kernels"]
    # Counting a CUDA graph once (XLA's command buffers): measured 12
    # against 124 on jax 0.10. jax 0.12's XLA records either update, GEMMs and all, into one graph:
    # 1 against 1.
    assert update["host_launches"] <= max(1, base_update["host_launches"] // 5)
  else:
    assert got.bytes_accessed <= base.bytes_accessed * 1.001
    assert update["io_bytes"] <= base_update["io_bytes"] * 1.001


# --- eight GPUs, data parallel -------------------------------------------------


def test_data_parallel_step_on_8_h100s_reduces_gradients():
  size = train_step.ModelSize(layers=2)
  config = next(c for c in train_step.CONFIGS if c.name == "bf16")
  report = train_step.compiled_step_report(config, size, "h100", devices=8)
  summary = report.collective_summary()
  assert any(k.startswith("all-reduce") for k in summary), summary
  assert report.devices == 8
  print(report)


# --- the fused update with flat params (issue 12's candidate) ----------------


# bf16-o2 only: the flat layout is no longer the default, and CI time is
# short (bf16+fused-flat, 86.2 GB, is in benchmarks/RESULTS.md).
@pytest.mark.parametrize("config", [c for c in train_step.FLAT_CONFIGS
                                    if c.name == "bf16-o2+fused-flat"],
                         ids=lambda c: c.name)
def test_flat_fused_update_is_one_kernel_pass_on_h100(config):
  """Params kept as the flat buffer: the update is the gradient assembly
  (fused with the finite check), the Pallas kernel and a few scalar kernels.
  On 1 of the 12 layers (CI time): the update's bytes are per param."""
  size = train_step.ModelSize(layers=1)
  report = gpt2_report(config.name, 1)
  update = report.scope(jmp_lab.training.UPDATE_SCOPE)
  per_param = update["io_bytes"] / train_step.param_count(size)
  assert update["kernels"] <= 8, update
  # Kernel: read g, master, m, v and write master, m, v (28 B with half
  # gradients), plus the half copy (2 B) or, with fp32 params, the fp32
  # update (4 B) and fp32 gradients; assembling the gradients costs their
  # read and write. Measured: 32.0 (bf16-o2) and 38.8 (bf16).
  budget = 32.5 if jmp_lab.get_policy(config.policy).param_dtype.itemsize == 2 else 39.0
  assert per_param <= budget, per_param
  (kernel,) = report.pallas_kernels
  assert kernel.spill_bytes == 0




# --- the lean step (issue 25): fused attention and a blockwise loss ------------


def test_gpt2_small_lean_step_against_bf16_and_fp32():
  """GPT-2-small, all 12 layers: cuDNN's attention (fp32 softmax inside the
  kernel) and jmp_lab.losses.linear_cross_entropy (its Pallas Triton
  kernels: no logits in memory) against today's mixed_bfloat16 step.
  Measured 2026-11-25: 0.37x the bytes (26.8 GB against 72.0; 0.46x with
  the loss's XLA path), 0.42x the args+temp and 0.27x fp32-highest's
  (benchmarks/RESULTS.md): the issue's targets are 0.40x, 0.5x and 0.33x."""
  lean = gpt2_report("bf16-lean")
  bf16 = gpt2_report("bf16", 12)
  fp32 = gpt2_report("fp32-highest", 12)
  memory = lambda r: r.memory["argument"] + r.memory["temp"]  # noqa: E731
  assert lean.bytes_accessed <= 0.40 * bf16.bytes_accessed
  assert memory(lean) <= 0.5 * memory(bf16)
  assert memory(lean) <= 0.33 * memory(fp32)
  assert lean.fp32_gemms == [] and lean.gemm_flop_share("16-bit") == 1.0
  calls = [k.op_name.rsplit("/", 1)[-1] for k in lean.kernel_records
           if k.opcode == "custom-call"]
  assert calls.count("dot_product_attention_fwd") == 12
  assert calls.count("dot_product_attention_bwd") == 12
  assert sorted(k.name for k in lean.pallas_kernels) == [
      "_hidden_gradient_kernel", "_rows_gradient_kernel",
      "_statistics_kernel"]
  assert all(k.spill_bytes == 0 for k in lean.pallas_kernels)
  # No stored (batch, heads, T, T) scores, no (tokens, vocabulary) logits,
  # in any dtype.
  for shape in ("[8,12,1024,1024]", "[8,1024,50304]", "[8192,50304]"):
    assert shape not in lean.hlo_text, shape
  assert "[8,12,1024,1024]" in bf16.hlo_text or "[96,1024,1024]" in (
      bf16.hlo_text)


# --- fp8 on GPT-2-small (issue 27) -------------------------------------------


def test_gpt2_small_fp8_step_is_no_slower_than_bf16_in_the_model():
  """GPT-2-small, all 12 layers, mixed_fp8 (delayed scaling) against
  mixed_bfloat16, compiled for an H100: issue 27's targets for it, at most
  1.3x the kernels and 1.0x the roofline model's time. Measured 2026-11-25:
  1,645 / 1,325 = 1.24x (1,721 before each Dense layer's output gradient
  was cast into both fp8 layouts in one kernel) and 26.17 / 28.55 ms =
  0.92x (benchmarks/RESULTS.md)."""
  fp8 = gpt2_report("bf16-fp8")
  bf16 = gpt2_report("bf16", 12)
  assert fp8.kernels <= 1.3 * bf16.kernels, (fp8.kernels, bf16.kernels)
  assert (fp8.roofline_seconds()["total"]
          <= bf16.roofline_seconds()["total"])
