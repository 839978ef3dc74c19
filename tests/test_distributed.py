"""Real jax.distributed processes on loopback (examples/distributed.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import CPU_COMPILE_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(tmp_path, processes, devices_per_process, *extra):
  out = tmp_path / f"{processes}x{devices_per_process}.json"
  # The processes set their own device count; keep only the CPU compile flags.
  env = dict(os.environ, XLA_FLAGS=CPU_COMPILE_FLAGS)
  # Timeouts guard against a hang only (about 2 minutes on an idle 2-core
  # machine, several on a busy one).
  subprocess.run(
      [sys.executable, str(ROOT / "examples" / "distributed.py"),
       "--processes", str(processes),
       "--devices-per-process", str(devices_per_process), "--steps", "4",
       "--global-batch", "8", "--seq-len", "32", "--depth", "1",
       "--poison-step", "2",
       "--out", str(out), "--timeout", "900", *extra],
      check=True, env=env, timeout=1000)
  return json.loads(out.read_text())


@pytest.mark.floor_lane
def test_two_processes_of_four_devices_equal_one_process_of_eight(tmp_path):
  """ZeRO-1, reduce=float32, bf16 params: an inf in process 1's rows of one
  batch makes both processes skip that step, and the run is bit for bit the
  single-process 8-device run (same global batches, same mesh). The state
  the two processes save (orbax, each its own shards) restores onto a
  4-device mesh bit for bit."""
  two = run(tmp_path, 2, 4, "--poison-process", "1",
            "--ckpt-dir", str(tmp_path / "ckpt"))
  one = run(tmp_path, 1, 8, "--poison-process", "0")
  assert two["devices"] == one["devices"] == 8
  assert two["skipped_steps"] == one["skipped_steps"] == 1
  assert two["losses"][2] == float("inf")
  assert two["losses"] == one["losses"]
  assert two["params_sha256"] == one["params_sha256"]
  # ZeRO-1 over 8 devices, whatever the processes.
  assert two["opt_state_bytes_per_device"] == one["opt_state_bytes_per_device"]
  assert two["state_sha256"] == one["state_sha256"]
  four = run(tmp_path, 1, 4, "--restore", str(tmp_path / "ckpt"), "--steps", "0")
  assert four["restored_state_sha256"] == two["state_sha256"]
  assert four["opt_state_bytes_per_device"] == pytest.approx(
      2 * two["opt_state_bytes_per_device"], rel=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "6"], "must split evenly over 8 devices"),
    (["--processes", "0"], "--processes must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 0"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
  sys.path.insert(0, str(ROOT / "examples"))
  import distributed
  with pytest.raises(SystemExit):
    distributed.parse_args(argv)
  assert message in capsys.readouterr().err
