"""The README's code and the examples run as written."""

import pathlib
import re
import runpy
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_python_blocks():
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs(index, capsys):
  exec(compile(readme_python_blocks()[index], f"README block {index}", "exec"),
       {"__name__": "__readme__"})


def test_readme_has_the_two_setup_commands_at_the_top():
  head = (ROOT / "README.md").read_text()[:1200]
  assert 'pip install -e ".[examples]" && python examples/' in head
  assert 'pip install -e ".[dev]" && python -m pytest' in head


def run_example(name, *args):
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    module = runpy.run_path(str(ROOT / "examples" / name))
    return module["main"](list(args))
  finally:
    sys.path.pop(0)


def test_quickstart_example_smoke():
  accuracy = run_example("quickstart.py", "--steps", "30")
  assert 0.0 <= accuracy <= 1.0
