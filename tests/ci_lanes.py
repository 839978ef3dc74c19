"""Which CI lane runs which of the suite's heaviest test functions.

CI runs the suite on two jax versions (``.ci/run``): the floor lane (jax
0.10.2) and the newest lane (jax >= 0.11). Most tests are cheap and run on
both. The test functions listed in ``tests/lanes.txt`` each cost seconds of
XLA compiling a lane; each runs on the one lane the file names, so that the
suite's most expensive checks run once a CI run rather than twice (the run
had grown to 85 of its 90 minutes). ``.ci/assign_lanes.py`` writes the file
from the times pytest measured on each lane; ``docs/development.md`` says
when and how to refresh it. Tests marked ``floor_lane``, ``newest_lane`` or
``model_compile`` keep their markers.

This module holds only what both ``tests/conftest.py`` and
``.ci/assign_lanes.py`` need: the key a test function is listed under and
the file's reader.
"""

import pathlib
import re

LANES_FILE = pathlib.Path(__file__).with_name("lanes.txt")
LANES = ("floor", "newest")
_PARAMETERS = re.compile(r"\[.*\]$")


def function_key(nodeid: str) -> str:
  """``file.py::[Class::]function``: a test's node id without its folder or
  its parameters, so that all of a function's cases share one entry.

  >>> function_key("tests/test_fp8.py::test_dense[mxfp8-linen]")
  'test_fp8.py::test_dense'
  >>> function_key("tests/test_nnx.py::TrainStepTest::test_step")
  'test_nnx.py::TrainStepTest::test_step'
  """
  path, _, rest = nodeid.partition("::")
  return path.rsplit("/", 1)[-1] + "::" + _PARAMETERS.sub("", rest)


def read_lanes(path: pathlib.Path = LANES_FILE) -> dict[str, str]:
  """``{function key: lane}`` from a lanes file: one ``LANE KEY`` a line,
  ``#`` comments. A file that is missing lists nothing (every test runs on
  both lanes); a line with an unknown lane, or a function listed twice, is
  an error, not a silent choice."""
  if not path.exists():
    return {}
  lanes = {}
  for number, line in enumerate(path.read_text().splitlines(), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    lane, _, key = line.partition(" ")
    if lane not in LANES or not key.strip():
      raise ValueError(f"{path}:{number}: expected 'LANE file.py::test' with "
                       f"LANE one of {LANES}, got {line!r}")
    key = key.strip()
    if key in lanes:
      raise ValueError(f"{path}:{number}: {key} is listed twice")
    lanes[key] = lane
  return lanes
