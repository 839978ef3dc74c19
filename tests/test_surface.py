"""The public surface: what the API page documents is exactly what each face
exports, every public name is documented, and every import path the README,
the docs and the examples use works."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re
import warnings

import pytest

import jmp_lab

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"


def documented_members() -> dict[str, set[str]]:
  """``{module: names}`` the API page documents: each ``automodule``'s
  ``:members:`` list and every ``autofunction``/``autoclass``/``autodata``
  entry."""
  found: dict[str, set[str]] = {}
  module = None
  for line in API.read_text().splitlines():
    if m := re.match(r"\.\. automodule:: (\S+)", line):
      module = m.group(1)
      found.setdefault(module, set())
    elif (m := re.match(r"\s+:members:(.*)", line)) and module:
      found[module] |= {n.strip() for n in m.group(1).split(",") if n.strip()}
    elif m := re.match(r"\.\. auto(?:function|class|data)::\s+(\S+)", line):
      owner, name = m.group(1).rsplit(".", 1)
      found.setdefault(owner, set()).add(name)
  return found


def public_modules() -> list[str]:
  names = ["jmp_lab"]
  for info in pkgutil.walk_packages(jmp_lab.__path__, "jmp_lab."):
    if not any(part.startswith("_") for part in info.name.split(".")):
      names.append(info.name)
  return names


DOCUMENTED = documented_members()
# Faces the API page documents by module; jmp_lab itself re-exports them.
FACES = sorted(m for m in DOCUMENTED if m != "jmp_lab")


@pytest.mark.parametrize("module_name", FACES)
def test_a_face_exports_exactly_what_the_api_page_documents(module_name):
  module = importlib.import_module(module_name)
  exported = set(module.__all__)
  assert exported == DOCUMENTED[module_name], (
      f"{module_name}: exported but undocumented "
      f"{sorted(exported - DOCUMENTED[module_name])}, documented but not "
      f"exported {sorted(DOCUMENTED[module_name] - exported)}")
  for name in exported:
    assert hasattr(module, name), f"{module_name}.{name}"


def test_every_top_level_name_is_a_documented_faces_name():
  owners = {}
  for face in FACES:
    module = importlib.import_module(face)
    for name in module.__all__:
      owners.setdefault(id(getattr(module, name)), []).append(f"{face}.{name}")
  for name in jmp_lab.__all__:
    value = getattr(jmp_lab, name)
    assert id(value) in owners or name in FACES or (
        f"jmp_lab.{name}" in FACES), f"jmp_lab.{name} is documented nowhere"


def _docs_text() -> str:
  return "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md")
                   if "_build" not in p.parts)


@pytest.mark.parametrize("module_name", public_modules())
def test_every_public_module_declares_its_names_and_the_docs_name_them(
    module_name):
  module = importlib.import_module(module_name)
  assert hasattr(module, "__all__"), f"{module_name} has no __all__"
  docs = _docs_text()
  undocumented = [n for n in module.__all__
                  if not re.search(rf"\b{re.escape(n)}\b", docs)]
  assert not undocumented, f"{module_name}: {undocumented} on no docs page"


def _code_of(path: pathlib.Path) -> list[str]:
  """The Python a page or script holds: a script whole, a Markdown page's
  fenced ``python`` blocks and ``>>>`` lines."""
  text = path.read_text()
  if path.suffix == ".py":
    return [text]
  blocks = re.findall(r"```(?:python|py)\n(.*?)```", text, flags=re.S)
  blocks += ["\n".join(line.split(">>> ", 1)[1] for line in text.splitlines()
                       if ">>> " in line)]
  return blocks


def _import_paths(code: str) -> set[tuple[str, str]]:
  """``(module, name)`` for each ``from jmp_lab... import name`` and
  ``("jmp_lab.x.y", "")`` for each ``import jmp_lab.x.y``."""
  try:
    tree = ast.parse(code)
  except SyntaxError:
    return set()
  paths = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "jmp_lab"):
      paths |= {(node.module, a.name) for a in node.names}
    elif isinstance(node, ast.Import):
      paths |= {(a.name, "") for a in node.names
                if a.name.startswith("jmp_lab")}
  return paths


def _dotted_references(text: str) -> set[str]:
  """``jmp_lab.a.b`` references in prose and code (calls and attributes)."""
  return {m.rstrip(".") for m in re.findall(r"\bjmp_lab(?:\.[A-Za-z_]\w*)+",
                                             text)}


USER_FILES = ([ROOT / "README.md"]
              + sorted(p for p in (ROOT / "docs").rglob("*.md")
                       if "_build" not in p.parts)
              + sorted((ROOT / "examples").glob("*.py")))


def _resolve(dotted: str):
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      value = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    for attr in parts[cut:]:
      value = getattr(value, attr)
    return value
  raise ImportError(dotted)


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: p.name)
def test_every_import_path_the_readme_docs_and_examples_use_works(path):
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # no retired name
    for code in _code_of(path):
      for module_name, name in _import_paths(code):
        module = importlib.import_module(module_name)
        if name and name != "*":
          assert hasattr(module, name) or importlib.import_module(
              f"{module_name}.{name}"), f"from {module_name} import {name}"
    for dotted in _dotted_references(path.read_text()):
      if dotted.startswith("jmp_lab._src"):
        continue  # the development page names private modules by path
      try:
        _resolve(dotted)
      except (ImportError, AttributeError) as e:
        pytest.fail(f"{path.name}: {dotted} does not resolve ({e})")


def test_nnx_fp8_meta_is_a_deprecated_name_for_fp8_state():
  import jmp_lab.nnx as jnnx
  with pytest.warns(DeprecationWarning, match="Fp8State"):
    assert jnnx.Fp8Meta is jnnx.Fp8State
  with pytest.raises(AttributeError, match="no attribute 'Fp8Metas'"):
    jnnx.Fp8Metas  # noqa: B018


# The layers of docs/development.md, bottom up: a module imports only from
# its own layer and those below; the optimizers and the engine (one floor)
# do not import each other.
LAYERS = [
    ("kernels", [r"jmp_lab\.kernels(\..*)?", r"jmp_lab\._compat"]),
    ("base", [r"jmp_lab\._nesting", r"jmp_lab\._src\.precision\.scopes",
              r"jmp_lab\._src\.policy", r"jmp_lab\._src\.matmul_modes",
              r"jmp_lab\._src\.matmuls",
              r"jmp_lab\._src\.sharding", r"jmp_lab\._checks",
              r"jmp_lab\._gemm", r"jmp_lab\._src\.cuda_plugin",
              r"jmp_lab\._src\.user_warnings",
              r"jmp_lab\._src"]),
    ("numerics", [r"jmp_lab\._src\.numerics(\..*)?"]),
    ("optimizers", [r"jmp_lab\._src\.optim(\..*)?", r"jmp_lab\._src\.loss_scale",
                    r"jmp_lab\._src\.jmp_compat"]),
    ("engine", [r"jmp_lab\._src\.precision(\..*)?",
                r"jmp_lab\._src\.precision_warnings"]),
    ("training", [r"jmp_lab\._src\.training(\..*)?"]),
    ("diagnostics", [r"jmp_lab\.diagnostics(\..*)?"]),
    ("faces", [r"jmp_lab(\..*)?"]),
]
FLOOR = {"kernels": 0, "base": 1, "numerics": 2, "optimizers": 3, "engine": 3,
         "training": 4, "diagnostics": 5, "faces": 6}


def _layer(module: str) -> str:
  for name, patterns in LAYERS:
    if any(re.fullmatch(p, module) for p in patterns):
      return name
  raise AssertionError(module)


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in (ROOT / "jmp_lab").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found[name] = path
  return found


def _imports(path: pathlib.Path, modules) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "jmp_lab"):
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        found.add(full if full in modules else node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("jmp_lab")}
  return found


def test_every_module_imports_only_its_layer_and_those_below():
  modules = _modules()
  wrong = []
  for name, path in sorted(modules.items()):
    mine = _layer(name)
    for target in _imports(path, modules):
      if target.startswith(name + "."):
        continue  # a package's face importing its own modules
      theirs = _layer(target)
      if FLOOR[theirs] > FLOOR[mine] or (
          FLOOR[theirs] == FLOOR[mine] and theirs != mine):
        wrong.append(f"{name} ({mine}) imports {target} ({theirs})")
  assert not wrong, "\n".join(wrong)
