"""Smoke tests: the benchmark harnesses run (CPU figures are not claims)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import fused_update, multi_tensor_compile, train_step  # noqa: E402
from cuda_compile import require_cuda_plugin  # noqa: E402


def test_train_step_harness_small(capsys, tmp_path):
  rows = train_step.main(["--small", "--warmup", "1", "--steps", "1",
                          "--configs", "fp32-highest,fp16+fused",
                          "--plot", str(tmp_path / "steps.png")])
  assert [r["name"] for r in rows] == ["fp32-highest", "fp16+fused"]
  assert all(r["seconds"] > 0 and r["flops"] > 0 for r in rows)
  out = capsys.readouterr().out
  assert "| fp16+fused |" in out and "vs TF32" in out
  assert (tmp_path / "steps.png").stat().st_size > 5000


@pytest.mark.parametrize("capacity, upper, expected", [
    (37, 4096, 37), (1, 4096, 1), (0, 4096, 0), (5000, 4096, 4096), (64, 64, 64)])
def test_largest_batch_bisection(capacity, upper, expected):
  calls = []

  def fits(batch):
    calls.append(batch)
    return batch <= capacity

  assert train_step.largest_fitting(fits, upper) == expected
  assert len(calls) <= 2 * 13 + 2  # logarithmic in the answer


def test_fused_update_benchmark_small(capsys):
  fused_update.main(["--sizes", "20K", "--warmup", "1", "--repeats", "2"])
  out = capsys.readouterr().out
  for name in ("fused tree (new params)", "fused tree (updates + apply_updates)",
               "fused flat (tree grads)", "fused flat (flat params)", "unfused",
               "copy"):
    assert name in out


def test_multi_tensor_compile_benchmark_small(capsys):
  """Both Triton kernels over 2 leaves and the Mosaic GPU probe over 1,
  compiled for an H100."""
  require_cuda_plugin()
  multi_tensor_compile.main(["--leaves", "2", "--mosaic-leaves", "1"])
  out = capsys.readouterr().out
  for row in ("| Triton statistics | 2 |", "| Triton update | 2 |",
              "| Mosaic GPU update (probe) | 1 |"):
    assert row in out, out


def test_flat_kernels_benchmark_small(capsys):
  """benchmarks/quantized_update.py --flat-kernels, on small buffers: both
  GPU backends compile the 8-bit flat kernel at its ideal bytes."""
  require_cuda_plugin()
  from benchmarks import quantized_update  # pylint: disable=import-outside-toplevel
  quantized_update.main_flat_kernels(["int8"], rows=132 * 8)
  out = capsys.readouterr().out
  for backend in ("triton", "mosaic"):
    row = next(line for line in out.splitlines()
               if line.startswith(f"| {backend} | int8 |"))
    assert row.endswith("| 1.000 |"), row


def test_gpu_script_runs_jax_and_torch_in_processes_of_their_own(tmp_path):
  """jax's allocator keeps what it once held: torch gets a process of its own,
  and jax allocates on demand up to 95% of the card."""
  import os
  import subprocess
  run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"),
                        str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "GPU_RUN_DRY": "1"}, check=True)
  commands = [line for line in run.stdout.splitlines() if ": XLA_" in line]
  assert {c.split(" (limit")[0] for c in commands} == {
      "kernels", "fused_update", "fused_update_torch", "train_step",
      "train_step_torch", "fp8", "fp8_1.3b", "lean", "loss_kernels",
      "compiled", *TIMING_RUNS}
  for command in commands:
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in command
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in command
    # Exactly one framework per benchmark process (the timings table only
    # reads JSON files).
    if "benchmarks/" in command and "benchmarks/timings.py" not in command:
      assert ("--no-torch" in command) != ("--torch-only" in command), command
  assert not (tmp_path / "environment.txt").exists()  # nothing was run


def test_torch_only_mode_runs_without_jax_rows(capsys):
  train_step.main(["--small", "--torch-only", "--configs", "bf16"])
  out = capsys.readouterr().out
  assert "| config | median step ms" in out  # torch has no GPU here: no rows


def test_train_step_hands_llama7b_its_own_arguments(capsys):
  """``train_step.py --llama7b`` passes every other argument to llama7b.py
  (train_step's own ``--layers`` and ``--configs`` had swallowed them, and
  the whole 32-layer model with every config was compiled)."""
  rows = train_step.main(["--llama7b", "--layers", "1", "--configs",
                          "bf16-params", "--meshes", "fsdp=8"])
  assert [(r.config, r.mesh) for r in rows] == [("bf16-params", "fsdp=8")]
  assert "1-layer Llama" in capsys.readouterr().out


TIMING_RUNS = ("timings_fused", "timings_fused_torch", "timings_step",
               "timings_step_torch", "timings_fp8", "timings")


def _dry_run(tmp_path, *parts):
  import os
  import subprocess
  run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"),
                        str(tmp_path), *parts], capture_output=True,
                       text=True, env={**os.environ, "GPU_RUN_DRY": "1"},
                       check=True)
  return [line for line in run.stdout.splitlines() if ": XLA_" in line]


def test_the_timings_part_fits_one_call_of_nine_minutes(tmp_path):
  """``gpu_run.sh OUT timings``: P1-P5's runs, each framework in its own
  process, within 9 minutes of time limits in all (the fp8 run only takes
  what is left), writing the files benchmarks/timings.py reads, and the
  table last."""
  import re  # pylint: disable=import-outside-toplevel
  from benchmarks import timings  # pylint: disable=import-outside-toplevel
  commands = _dry_run(tmp_path, "timings")
  names = [c.split(" (limit")[0] for c in commands]
  assert names == list(TIMING_RUNS)
  limits = [int(re.search(r"\(limit (\d+) s\)", c).group(1))
            for c in commands]
  assert sum(limits) <= 9 * 60, limits
  for command in commands[:-1]:
    assert ("--no-torch" in command) != ("--torch-only" in command), command
  written = {re.search(r"--json \S+/(\S+)", c).group(1)
             for c in commands[:-1]}
  assert written == set(timings.FILES.values())
  assert commands[-1].endswith(f"benchmarks/timings.py {tmp_path}")
  assert not (tmp_path / "environment.txt").exists()  # nothing was run


def test_the_timings_table_reads_what_the_timing_runs_write(tmp_path, capsys):
  """The CPU's own figures through the same writers and reader: the ratios
  are the JSON files' medians divided, and what did not run says so."""
  import json  # pylint: disable=import-outside-toplevel
  from benchmarks import fused_update, timings  # pylint: disable=import-outside-toplevel
  fused_update.main(["--sizes", "64K", "--warmup", "1", "--repeats", "1",
                     "--no-torch", "--json", str(tmp_path / "timings_fused.json")])
  train_step.main(["--small", "--configs", "bf16", "--warmup", "1", "--steps",
                   "1", "--no-torch", "--no-batch-search", "--json",
                   str(tmp_path / "timings_step.json")])
  rows = {(r["figure"], r["what"]): r for r in timings.main([str(tmp_path)])}
  fused = json.loads((tmp_path / "timings_fused.json").read_text())["rows"]
  seconds = {r["path"]: r["seconds"] for r in fused}
  p2 = rows[("P2", "unfused / fused update time")]
  assert p2["value"] == seconds[timings.UNFUSED_PATH] / seconds[
      timings.FUSED_PATH]
  assert rows[("P1", "fused update bandwidth / device copy bandwidth")][
      "value"] > 0
  assert rows[("P3", "torch AdamW(fused)+GradScaler / fused update time")][
      "value"] is None  # torch did not run: "not run", never a zero
  assert rows[("P4", "GPT-2 small step: TF32 / bf16 time")]["met"] is None
  out = capsys.readouterr().out
  assert "| P3 | torch AdamW(fused)+GradScaler / fused update time | not run |" in out
