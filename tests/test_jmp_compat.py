"""jmp's own test files, run against ``jmp_lab.jmp``.

The files ship in the jmp wheel (``jmp/_src/policy_test.py`` and
``jmp/_src/loss_scale_test.py``). Each is loaded with its one import
rewritten to ``from jmp_lab import jmp`` and every test in it runs here as a
pytest case. The cases where jmp_lab differs from jmp on purpose are strict
xfails, each with the reason README.md gives.
"""

import importlib.util
import pathlib
import types
import unittest

import pytest

JMP_SOURCES = pathlib.Path(importlib.util.find_spec("jmp").origin).parent / "_src"
IMPORTS = {
    "policy_test.py": "from jmp._src import policy as jmp",
    "loss_scale_test.py": "from jmp._src import loss_scale as jmp",
}

# Test id -> why jmp_lab differs (README.md, "Migrating from jmp").
DIFFERENCES = {
    "loss_scale_test.LossScaleTest.test_static_empty_trees_StaticLossScale":
        "StaticLossScale(0) is refused: a zero scale zeroes every gradient "
        "and unscaling divides by zero. (Its scale is also a leaf, so a new "
        "static scale does not recompile.)",
    "loss_scale_test.LossScaleTest.test_dynamic_loss_scale_explicit_min_loss_scale2":
        "min_loss_scale=0 is refused for the same reason: the scale must stay "
        "> 0.",
    "loss_scale_test.LossScaleTest.test_select_tree_rejects_non_scalar":
        "a non-scalar predicate raises TypeError (bad input is a TypeError or "
        "ValueError in jmp_lab), not AssertionError.",
}


def _load(filename):
  source = (JMP_SOURCES / filename).read_text()
  assert IMPORTS[filename] in source, f"jmp's {filename} changed its import"
  source = source.replace(IMPORTS[filename], "from jmp_lab import jmp")
  module = types.ModuleType(filename[:-3])
  exec(compile(source, str(JMP_SOURCES / filename), "exec"), module.__dict__)
  return module


def _cases():
  cases = []
  for filename in IMPORTS:
    suite = unittest.defaultTestLoader.loadTestsFromModule(_load(filename))
    stack = [suite]
    while stack:
      item = stack.pop()
      if isinstance(item, unittest.TestSuite):
        stack.extend(item)
      else:
        name = f"{filename[:-3]}.{type(item).__name__}.{item._testMethodName}"
        cases.append(pytest.param(
            item, id=name,
            marks=[pytest.mark.xfail(strict=True, reason=DIFFERENCES[name])]
            if name in DIFFERENCES else []))
  return sorted(cases, key=lambda p: p.id)


CASES = _cases()


def test_all_of_jmps_tests_are_collected():
  assert len(CASES) == 97  # jmp 0.0.4: 97 tests in the two files
  assert set(DIFFERENCES) <= {p.id for p in CASES}


@pytest.mark.parametrize("case", CASES)
def test_jmp_test_passes_against_jmp_lab(case):
  result = unittest.TestResult()
  case.run(result)
  problems = result.failures + result.errors
  assert not problems, problems[0][1]
  assert result.testsRun == 1
