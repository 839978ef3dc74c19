"""tests/lanes.txt, the list of heavy test functions that CI runs on one
lane only (tests/ci_lanes.py): it reads as it says, refuses what it cannot
read, and names only test functions that exist."""

import ast
import pathlib
import re

import pytest

import ci_lanes

TESTS = pathlib.Path(__file__).resolve().parent


def test_a_lanes_file_maps_each_function_to_its_lane(tmp_path):
  path = tmp_path / "lanes.txt"
  path.write_text("# a comment\n"
                  "floor  test_a.py::test_one   # why\n"
                  "\n"
                  "newest test_b.py::Case::test_two\n")
  assert ci_lanes.read_lanes(path) == {"test_a.py::test_one": "floor",
                                       "test_b.py::Case::test_two": "newest"}
  assert ci_lanes.read_lanes(tmp_path / "missing.txt") == {}


@pytest.mark.parametrize("line, error", [
    ("gpu test_a.py::test_one", "expected 'LANE file.py::test'.*'gpu "),
    ("floor", "expected 'LANE file.py::test'.*'floor'"),
    ("newest test_a.py::test_zero", "test_a.py::test_zero is listed twice"),
])
def test_a_line_it_cannot_read_is_an_error_naming_the_line(tmp_path, line,
                                                            error):
  path = tmp_path / "lanes.txt"
  path.write_text(f"floor test_a.py::test_zero\n{line}\n")
  with pytest.raises(ValueError, match=rf"lanes.txt:2: {error}"):
    ci_lanes.read_lanes(path)


def _defined_names(path: pathlib.Path) -> set[str]:
  """``function`` and ``Class::method`` for every function a test file
  defines."""
  names = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.FunctionDef):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef):
      names |= {f"{node.name}::{item.name}" for item in node.body
                if isinstance(item, ast.FunctionDef)}
    elif isinstance(node, ast.Assign):  # hypothesis' state machines' TestCase
      names |= {f"{target.id}::runTest" for target in node.targets
                if isinstance(target, ast.Name)}
  return names


def test_every_listed_function_exists():
  """A renamed or removed test leaves no stale line behind (it would run on
  both lanes again without anyone noticing). chex.variants adds
  ``__with_jit``-style suffixes and parameters to a method's name, absl's
  ``parameterized`` a case's number."""
  listed = ci_lanes.read_lanes()
  assert listed, "tests/lanes.txt lists nothing"
  defined = {}
  stale = []
  for key in listed:
    file_name, _, name = key.partition("::")
    if file_name not in defined:
      path = TESTS / file_name
      defined[file_name] = _defined_names(path) if path.exists() else set()
    base = re.split(r"__with|__without|_\(", name)[0]
    if not {base, base.rstrip("0123456789")} & defined[file_name]:
      stale.append(key)
  assert not stale, f"tests/lanes.txt names tests that do not exist: {stale}"
