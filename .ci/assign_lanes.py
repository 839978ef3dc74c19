"""Writes tests/lanes.txt: which of the suite's heaviest test functions run on
one CI lane only, from the times pytest measured (--durations=0 logs).

CI runs every test on two jax versions (.ci/run). Most tests are cheap and
run on both; a function whose cases cost --threshold seconds or more of
worker time on a lane runs on one lane, so that the suite's most expensive
checks run once a CI run, not twice. Each goes to the lane where the two
lanes' totals come out most even (longest first), which also leaves the
floor lane (jax 0.10.2, whose older CPU emitters compile about 1.3-2x
faster) with most of them. Tests that need both jax versions to mean
something stay on both (PINNED_BOTH, and any test marked floor_lane,
newest_lane, model_compile or eight_devices keeps its own marker).

  python .ci/assign_lanes.py FLOOR_LOG [NEWEST_LOG] > tests/lanes.txt

FLOOR_LOG and NEWEST_LOG are the output of each lane's
``pytest -n 2 --durations=0 ...`` (CI's own command with --durations=0).
A function that one log skipped because the tests/lanes.txt in use put it
on the other lane is estimated from the other lane's time, --newest-factor
times the floor's on the newest lane. Without NEWEST_LOG every newest-lane
cost is estimated so, and the newest lane's own tests (model_compile,
newest_lane) as --newest-only seconds in all. docs/development.md says
how and when to refresh the file.
"""

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import ci_lanes  # noqa: E402  (tests/ci_lanes.py)

# Functions that run on both lanes whatever they cost: what the issues ask
# of both jax versions (the B200 block-scaled GEMMs of a whole step), the
# code blocks of every docs page and of the README (a user on either jax
# follows the same pages), and the Pallas kernels' own lowering and
# interpretation (jax's Pallas and Mosaic GPU APIs change between versions;
# jmp_lab._compat bridges them).
PINNED_BOTH = (
    "test_block_scaled.py::test_every_gemm_compiles_to_cudnns_block_scaled_dot_for_a_b200",
    "test_docs_and_examples.py::test_docs_page_python_blocks_run",
    "test_docs_and_examples.py::test_readme_python_block_runs",
    "test_compiled.py::test_multi_tensor_kernels_compile_for_sm90a_in_place",
    "test_kernels.py::test_mosaic_kernel_quantizes_a_row_a_block_as_the_reference",
)
ONE_LANE_MARKERS = ("floor_lane", "newest_lane", "model_compile", "eight_devices")
_DURATION = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S.*)$")


def seconds_by_function(log_path: str) -> collections.Counter:
  """Worker seconds of each test function (setup, call and teardown of all
  its cases) in a --durations=0 log."""
  totals = collections.Counter()
  with open(log_path, encoding="utf-8") as log:
    text = log.read()
  # --durations=30 (CI's own command) names only the slowest 30 tests:
  # every other function would look free and stay on both lanes.
  if "= slowest durations =" not in text:
    raise SystemExit(f"{log_path}: no '--durations=0' table (pytest prints "
                     "'slowest durations' for it; CI's --durations=30 names "
                     "30 tests only)")
  for line in text.splitlines():
    match = _DURATION.match(line)
    if match and match.group(2).startswith("tests/"):
      totals[ci_lanes.function_key(match.group(2))] += float(match.group(1))
  return totals


def fill_in_the_other_lane(floor, newest, newest_factor, listed):
  """A function that one log did not run costs its time on the other lane,
  times ``newest_factor`` from the floor to the newest lane: with no newest
  log, every function; with both, those that the tests/lanes.txt in use
  (``listed``) put on the other lane. A test that skips itself on one jax
  keeps its (nil) time there, so it is never given to a lane where it
  would not run."""
  no_newest_log = not newest
  for key in set(floor) | set(newest):
    if no_newest_log or listed.get(key) == "floor":
      newest[key] = floor.get(key, 0.0) * newest_factor
    elif listed.get(key) == "newest":
      floor[key] = newest.get(key, 0.0) / newest_factor


def markers_by_function() -> dict:
  """The one-lane markers of each collected test function."""
  # A fresh process: pytest imports tests/conftest.py, which starts jax.
  probe = ("import json, sys, pytest\n"
           "sys.path.insert(0, 'tests')\n"
           "from ci_lanes import function_key\n"
           "out = {}\n"
           "class Probe:\n"
           "  def pytest_collection_finish(self, session):\n"
           "    for item in session.items:\n"
           f"      names = [n for n in {ONE_LANE_MARKERS!r} if item.get_closest_marker(n)]\n"
           "      out.setdefault(function_key(item.nodeid), set()).update(names)\n"
           "code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider',"
           " 'tests'], plugins=[Probe()])\n"
           "print('MARKERS', json.dumps({k: sorted(v) for k, v in out.items()}))\n"
           "sys.exit(code)\n")
  result = subprocess.run(
      [sys.executable, "-c", probe], capture_output=True, text=True,
      check=True, cwd=pathlib.Path(__file__).resolve().parents[1],
      env={**os.environ, "JMP_LAB_MODEL_COMPILES": "all"})
  line = next(l for l in result.stdout.splitlines() if l.startswith("MARKERS "))
  return json.loads(line[len("MARKERS "):])


def assign(floor, newest, markers, threshold, newest_only_seconds):
  """{function: lane} for the heavy functions, and the two lanes' totals."""
  lanes = {"floor": 0.0, "newest": newest_only_seconds}
  heavy = []
  for key in sorted(set(floor) | set(newest)):
    marks = markers.get(key, [])
    cost = {"floor": floor.get(key, 0.0), "newest": newest.get(key, 0.0)}
    if "floor_lane" in marks or "eight_devices" in marks:
      lanes["floor"] += cost["floor"]
    elif "newest_lane" in marks or "model_compile" in marks:
      lanes["newest"] += cost["newest"]
    elif key in PINNED_BOTH or max(cost.values()) < threshold:
      lanes["floor"] += cost["floor"]
      lanes["newest"] += cost["newest"]
    elif key in markers:
      heavy.append((key, cost))
  chosen = {}
  for key, cost in sorted(heavy, key=lambda kc: -max(kc[1].values())):
    lane = min(lanes, key=lambda name: lanes[name] + cost[name])
    lanes[lane] += cost[lane]
    chosen[key] = lane
  return chosen, lanes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("floor_log")
  parser.add_argument("newest_log", nargs="?")
  parser.add_argument("--threshold", type=float, default=2.0)
  parser.add_argument("--newest-factor", type=float, default=1.3)
  parser.add_argument("--newest-only", type=float, default=900.0)
  args = parser.parse_args()
  floor = seconds_by_function(args.floor_log)
  newest = (seconds_by_function(args.newest_log) if args.newest_log
            else collections.Counter())
  newest_only = 0.0 if args.newest_log else args.newest_only
  fill_in_the_other_lane(floor, newest, args.newest_factor,
                         ci_lanes.read_lanes())
  chosen, lanes = assign(floor, newest, markers_by_function(), args.threshold,
                         newest_only)
  print("# Test functions that run on one CI lane only (tests/conftest.py reads this;")
  print("# written by .ci/assign_lanes.py from measured times: docs/development.md).")
  print(f"# Predicted worker seconds: floor {lanes['floor']:.0f}, newest {lanes['newest']:.0f}.")
  for key in sorted(chosen):
    print(f"{chosen[key]:6s} {key}")


if __name__ == "__main__":
  main()
