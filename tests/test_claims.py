"""The README's and the docs' claims agree with their sources.

Each claim a program can check is checked against the file it comes from,
not against a copy of its wording:

* jax versions: the floor is ``pyproject.toml``'s; the newest lane's and the
  GPU machines' versions are ``docs/development.md``'s and appear in
  ``benchmarks/RESULTS.md``; the tests that need a newer jax
  (``tests/conftest.py``'s ``MODEL_COMPILES_FROM``) are named wherever a page
  says what CI runs on the floor;
* the GPU record: ``benchmarks/RESULTS.md`` says whether jmp_lab ran on a GPU
  (and on which, with which jax) and whether a step was timed there; the
  status paragraphs say the same;
* commands: the README's two setup commands, the test command ``.ci/run``
  reads, and every script (``python examples/X.py``, ``python
  benchmarks/X.py``, ``bash X.sh``) a page quotes, with its flags and extras;
* numbers: the README's bytes-per-parameter table against the optimizer
  states' shapes, and every figure a page quotes beside a link to the
  results against ``docs/results.md`` and ``benchmarks/RESULTS.md``;
* history: dates, issue numbers and "before this" stay out of the guides and
  the README (``benchmarks/RESULTS.md`` keeps them: it is the record).

Fast: it reads files, parses Python with ``ast`` and traces optimizer states
with ``jax.eval_shape`` (no compile).
"""

from __future__ import annotations

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lab

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS_RECORD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_PAGE = DOCS / "results.md"
DEVELOPMENT = DOCS / "development.md"

PAGES = [README] + sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
GUIDES = sorted((DOCS / "guides").glob("*.md"))
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def read(path: pathlib.Path) -> str:
  return path.read_text()


def flat(text: str) -> str:
  """Whitespace runs as one space: a claim wrapped over lines reads as one."""
  return re.sub(r"\s+", " ", text)


def prose(text: str) -> str:
  """The text outside fenced code blocks."""
  return re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)


def sentences(text: str) -> list[str]:
  return re.split(r"(?<=[.;:!?])\s+(?=[A-Z*(`])", flat(prose(text)))


def version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in version.split("."))


# ---------------------------------------------------------------------------
# The sources.
# ---------------------------------------------------------------------------


def jax_floor() -> str:
  """The oldest jax pyproject.toml accepts (its dependency on jax)."""
  text = read(ROOT / "pyproject.toml")
  (floor,) = re.findall(r'^\s*"jax>=([\d.]+)"', text, flags=re.M)
  return floor


def model_compiles_from() -> str:
  """The jax version from which tests/conftest.py runs `model_compile` tests."""
  tree = ast.parse(read(ROOT / "tests" / "conftest.py"))
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "MODEL_COMPILES_FROM"
        for t in node.targets):
      return ".".join(str(v) for v in ast.literal_eval(node.value))
  raise AssertionError("tests/conftest.py has no MODEL_COMPILES_FROM")


def development_lanes() -> dict[str, str]:
  """The jax versions docs/development.md gives for CI's lanes and the GPUs."""
  text = flat(read(DEVELOPMENT))
  floor = re.search(r"\*\*floor\*\*:.*?\*\*jax ([\d.]+\d)\*\*", text)
  newest = re.search(r"\*\*newest\*\*:.*?\(jax ([\d.]+\d)", text)
  gpu = re.search(r"The GPU machines run \*\*jax ([\d.]+\d) with the CUDA (\d+) "
                  r"plugin\*\*", text)
  assert floor and newest and gpu, "docs/development.md: a lane's version is missing"
  return {"floor": floor.group(1), "newest": newest.group(1),
          "gpu": gpu.group(1), "gpu_cuda": gpu.group(2)}


def gpu_record() -> dict:
  """What benchmarks/RESULTS.md records of runs on a GPU: the machines and
  jax versions the tests passed on, and whether any part that times ran."""
  text = read(RESULTS_RECORD)
  runs = re.findall(r"^## .*GPU run: an? (\w+) with jax ([\d.]+\d) and the CUDA "
                    r"(\d+) plugin", text, flags=re.M)
  # benchmarks/gpu_run.sh appends a "## GPU run of DATE" section with a
  # "### PART" subsection for each part it ran; every part but the tests'
  # (kernels, compiled) times steps or kernels.
  timed = False
  for section in re.split(r"^## ", text, flags=re.M):
    if section.startswith("GPU run of"):
      parts = set(re.findall(r"^### (\w+)", section, flags=re.M))
      timed |= bool(parts - {"kernels", "compiled", "loss_kernels"})
  return {"runs": runs, "timed": timed}


def results_text() -> str:
  return read(RESULTS_RECORD) + "\n" + read(RESULTS_PAGE)


# ---------------------------------------------------------------------------
# jax versions.
# ---------------------------------------------------------------------------


def test_the_floor_is_pyprojects_everywhere():
  floor = jax_floor()
  pyproject = read(ROOT / "pyproject.toml")
  # Every jax requirement (the extras too) has the same floor.
  assert set(re.findall(r'"jax(?:\[[\w-]+\])?>=([\d.]+)"', pyproject)) == {floor}
  assert development_lanes()["floor"] == floor
  for page in (README, DOCS / "index.md"):
    supported = re.findall(r"Supported: jax ([\d.]+\d)", flat(read(page)))
    assert supported == [floor], (page.name, supported)


def test_the_newest_lanes_jax_is_recorded_and_the_readme_names_the_same():
  lanes = development_lanes()
  assert lanes["newest"] in read(RESULTS_RECORD)
  assert version_tuple(lanes["newest"]) > version_tuple(lanes["floor"])
  readme = flat(read(README))
  named = re.findall(r"newest jax pip gives \(([\d.]+\d)", readme)
  assert named == [lanes["newest"]], named


def test_every_jax_version_a_page_names_is_one_ci_or_the_gpus_ran():
  """A version named is the floor, the newest lane's, the GPU machines' or
  the `model_compile` threshold, or a release series of one of them."""
  lanes = development_lanes()
  known = [lanes["floor"], lanes["newest"], lanes["gpu"], model_compiles_from()]
  for page in PAGES:
    for version in re.findall(r"\bjax (\d+\.\d+(?:\.\d+)*)", flat(read(page))):
      assert any(version_tuple(k)[:len(version_tuple(version))]
                 == version_tuple(version) for k in known), (page.name, version)


def test_no_page_says_every_test_runs_on_the_floor_when_some_need_a_newer_jax():
  floor, threshold = jax_floor(), model_compiles_from()
  if version_tuple(threshold) <= version_tuple(floor):
    return
  for page in PAGES:
    for sentence in sentences(read(page)):
      if re.search(r"\b(every|all( the)?) tests?\b", sentence, flags=re.I):
        assert f"jax {floor}" not in sentence, (page.name, sentence)


@pytest.mark.parametrize("page", [README, DOCS / "index.md", DEVELOPMENT],
                         ids=lambda p: p.name)
def test_pages_that_say_what_ci_runs_name_the_tests_that_skip_the_floor(page):
  threshold = model_compiles_from()
  text = flat(read(page))
  assert "`model_compile`" in text, page.name
  assert re.search(rf"\bon jax {re.escape(threshold)} and later\b", text), page.name


# ---------------------------------------------------------------------------
# The GPU record.
# ---------------------------------------------------------------------------

# Who, in a status line, would be said never to have run on a GPU: jmp_lab
# itself or its tests (one kernel that has not run on one is named as such).
_NEVER_RAN = re.compile(
    r"\b(jmp_lab|It|the tests|its tests|the kernels'(?: correctness)? tests)"
    r" (has|have) (not|never)( yet)? (been )?run on an? (GPU|H100|H200)")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_no_page_denies_the_gpu_run_the_record_holds(page):
  if not gpu_record()["runs"]:
    return
  text = flat(prose(read(page)))
  assert not _NEVER_RAN.search(text), (page.name, _NEVER_RAN.search(text).group())
  assert not re.search(r"not run on a GPU (yet|so far)", text), page.name


@pytest.mark.parametrize("page", [README, DOCS / "index.md", RESULTS_PAGE],
                         ids=lambda p: p.name)
def test_the_status_names_the_gpu_run_as_recorded(page):
  record, lanes = gpu_record(), development_lanes()
  text = flat(read(page))
  for gpu, jax_version, cuda in record["runs"]:
    # The GPU machines docs/development.md describes are the ones recorded.
    assert (jax_version, cuda) == (lanes["gpu"], lanes["gpu_cuda"]), (gpu, jax_version)
    assert re.search(rf"an {gpu} with jax {re.escape(jax_version)} and the CUDA "
                     rf"{cuda} plugin", text), (page.name, gpu, jax_version)
  says_untimed = bool(re.search(r"no step (and no kernel )?has been timed on a GPU",
                                text, flags=re.I))
  assert says_untimed == (not record["timed"]), page.name


# ---------------------------------------------------------------------------
# Commands.
# ---------------------------------------------------------------------------


def ci_test_command() -> str:
  """The test command as `.ci/run` reads it from the README: the lines
  between its markers, without the markers, the fences and blank lines."""
  run = read(ROOT / ".ci" / "run")
  start, end = re.search(r"sed -n '/(.+?)/,/(.+?)/p' README\.md", run).groups()
  start, end = start.replace("\\/", "/"), end.replace("\\/", "/")
  lines, inside = [], False
  for line in read(README).splitlines():
    if start in line:
      inside = True
    if inside and not line.startswith("<!--") and not line.startswith("```") \
        and line.strip():
      lines.append(line)
    if inside and end in line:
      break
  return "\n".join(lines)


def readme_bash_blocks() -> list[str]:
  return re.findall(r"```bash\n(.*?)```", read(README), flags=re.S)


def test_the_readme_opens_with_the_two_setup_commands():
  first, second = readme_bash_blocks()[:2]
  venv = "python3 -m venv .venv && . .venv/bin/activate && "
  assert first.startswith(venv + 'pip install -e ".[examples]" && python examples/')
  assert second.strip() == ci_test_command()
  assert second.startswith(venv + 'pip install -e ".[dev]" && ')
  head = read(README)[:read(README).index(second) + len(second)]
  assert head.count("```bash") == 2   # nothing else comes first


def test_the_test_command_is_the_one_ci_runs_and_builds_the_docs():
  command = ci_test_command()
  assert "\n" not in command, "one line, as .ci/run runs it"
  assert "sphinx-build" in command and " -W " in command   # "warnings as errors"
  assert "python -m pytest" in command
  # docs/development.md's command is the README's, less the durations table.
  dev_pytest = re.search(r"^python -m pytest .*$", read(DEVELOPMENT), flags=re.M)
  readme_pytest = command[command.index("python -m pytest"):].split()
  assert set(dev_pytest.group().split()) <= set(readme_pytest)


def test_the_main_examples_run_time_says_what_it_counts_and_is_recorded():
  """"About N s" is the example's run after the install, as the results page
  records it (the install's time depends on the network)."""
  readme = flat(read(README))
  (seconds,) = re.findall(r"about (\d+) s on 2 CPU cores, after the install", readme)
  section = read(RESULTS_PAGE).split("(results-digits-cnn)=")[1].split("\n(")[0]
  assert "`python examples/digits_cnn.py`" in section
  assert f"about {seconds} s on 2 CPU cores, after the install" in flat(section)


def extras() -> set[str]:
  text = read(ROOT / "pyproject.toml")
  block = text[text.index("[project.optional-dependencies]"):]
  block = block[:block.index("\n[", 1)]
  return set(re.findall(r"^([\w-]+) = ", block, flags=re.M))


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_extra_a_page_installs_is_one_pyproject_defines(page):
  for named in re.findall(r'pip install [^"`]*"\.\[([\w,-]+)\]"', read(page)):
    assert set(named.split(",")) <= extras(), (page.name, named)


def commands(text: str) -> list[str]:
  """Shell commands a page quotes: the lines of its bash blocks (joined over
  backslashes) and its inline code spans."""
  found = []
  for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, flags=re.S):
    found += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
  found += re.findall(r"`([^`]+)`", prose(text))
  return [flat(c).strip() for c in found]


_SCRIPT = re.compile(r"(?:^|\s)(?:python3?|bash)\s+((?:\./)?[\w./-]+\.(?:py|sh))\b(.*)")


def quoted_scripts(text: str) -> list[tuple[str, list[str]]]:
  """``(script, arguments)`` for each script a page runs; a command that
  starts with ``...`` goes on with the script quoted before it."""
  found, last = [], None
  for command in commands(text):
    match = _SCRIPT.search(command)
    if match:
      script, rest = match.group(1), match.group(2)
      rest = re.split(r"\s(?:&&|\|\||;|\||#|>)", rest + " ")[0]
      found.append((script, rest.split()))
      last = script
    elif command.startswith("... ") and last:
      rest = re.split(r"\s(?:&&|\|\||;|\||#|>)", command[4:] + " ")[0]
      found.append((last, rest.split()))
  return found


def accepted_flags(script: pathlib.Path) -> set[str]:
  """The option strings a script's argparse parsers accept, its own and
  those of the modules beside it that it imports (a shared parser)."""
  flags: set[str] = set()
  seen: set[pathlib.Path] = set()
  todo = [script]
  while todo:
    path = todo.pop()
    if path in seen or not path.exists():
      continue
    seen.add(path)
    tree = ast.parse(read(path))
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
        flags |= {a.value for a in node.args
                  if isinstance(a, ast.Constant) and isinstance(a.value, str)}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        todo.append(path.parent / (node.module.replace(".", "/") + ".py"))
      elif isinstance(node, ast.Import):
        todo += [path.parent / (a.name.replace(".", "/") + ".py") for a in node.names]
  return flags


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_script_a_page_quotes_exists_and_takes_its_flags(page):
  for script, arguments in quoted_scripts(read(page)):
    if script.startswith(("/", "$")) or "/" not in script:
      continue   # a path outside the repository, or a file the page has you write
    path = ROOT / script
    assert path.is_file(), (page.name, script)
    if path.suffix != ".py" or not path.parts[-2] in ("examples", "benchmarks"):
      continue
    accepted = accepted_flags(path)
    for i, argument in enumerate(arguments):
      if not argument.startswith("--"):
        continue
      flag = argument.split("=", 1)[0]
      assert flag in accepted, (page.name, script, flag)
      if flag == "--policy" and path.parts[-2] == "examples" and i + 1 < len(arguments):
        jmp_lab.get_policy(arguments[i + 1])   # a policy the example can parse


def test_the_quoted_scripts_are_found():
  """The parser above reads what the pages hold (it would pass on nothing)."""
  readme = dict(quoted_scripts(read(README)))
  assert readme["examples/digits_cnn.py"] == []
  quoted = {s for p in PAGES for s, _ in quoted_scripts(read(p))}
  assert {"examples/char_transformer.py", "benchmarks/train_step.py",
          "benchmarks/gpu_run.sh", "examples/fsdp_llama.py"} <= quoted
  flags = {a for p in PAGES for s, args in quoted_scripts(read(p))
           if s == "examples/fsdp_llama.py" for a in args}
  assert {"--optimizer", "--mesh", "--compare"} <= flags   # the "..." rows too
  assert "--compare" in accepted_flags(ROOT / "examples" / "digits_cnn.py")
  assert "--resume" in accepted_flags(ROOT / "examples" / "char_transformer_nnx.py")


# ---------------------------------------------------------------------------
# Numbers.
# ---------------------------------------------------------------------------

BF16_PARAMS = "p=bf16,c=bf16,o=f32"
# GPT-2-block shapes (768 wide), bf16: tests/test_quantized_moments.py's.
GPT2_BLOCK = {"attn": (768, 2304), "proj": (768, 768), "fc": (768, 3072),
              "out": (3072, 768), "ln": (768,), "bias": (3072,)}


def _fused(**kw):
  return jmp_lab.fused_adamw(1e-3, policy=BF16_PARAMS, **kw)


# The README's "AdamW as | B/param" rows, in order: a phrase of the row and
# the optimizer it names.
README_ROWS = [
    ("mixed_precision(optax.adamw)",
     lambda: jmp_lab.mixed_precision(optax.adamw(1e-3), policy=BF16_PARAMS)),
    ('fused_adamw(master="remainder")', lambda: _fused(master="remainder")),
    ("bf16 moments", lambda: _fused(master="remainder", mu_dtype=jnp.bfloat16,
                                    nu_dtype=jnp.bfloat16)),
    ("8-bit moments", lambda: _fused(master="remainder", mu_dtype="int8",
                                     nu_dtype="int8")),
    ('master="none", rounding="stochastic"', lambda: _fused(
        master="none", rounding="stochastic", mu_dtype="int8", nu_dtype="int8")),
]


def state_bytes_per_param(tx) -> float:
  """Params plus the optimizer state, per parameter, from shapes alone."""
  params = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in GPT2_BLOCK.items()}
  state = jax.eval_shape(tx.init, params)

  def nbytes(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return 8 * int(np.prod(x.shape))   # a key's two uint32 words
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize

  leaves = jax.tree_util.tree_leaves((params, state))
  return sum(nbytes(x) for x in leaves) / sum(
      int(np.prod(s)) for s in GPT2_BLOCK.values())


def test_the_readmes_bytes_per_parameter_are_the_optimizer_states():
  text = read(README)
  table = text[text.index("| AdamW as | B/param |"):]
  rows = re.findall(r"^\| (.+?) \| \**([\d.]+)\** \|$", table.split("\n\n")[0], flags=re.M)
  assert len(rows) == len(README_ROWS), rows
  for (label, quoted), (phrase, make) in zip(rows, README_ROWS):
    assert phrase in label, (label, phrase)
    assert round(state_bytes_per_param(make()), 2) == float(quoted), label
  assert [q for _, q in rows][-2:] == ["6.03", "4.03"]


_NUMBER = re.compile(r"(?<![\w.,/^-])(\d+(?:,\d{3})*(?:\.\d+)+|\d+(?=%)|\d+(?:\.\d+)?(?=×))")
_RESULTS_LINK = re.compile(r"\]\([^)]*(?:results\.md|RESULTS\.md)[^)]*\)")


def quoted_figures(text: str) -> list[str]:
  """The figures a page quotes beside a link to the results: decimals,
  percentages and ratios in each paragraph that links there, and in the
  table that follows it. Versions, links, code and exponents are left out."""
  blocks = re.split(r"\n\s*\n", prose(text))
  figures = []
  for i, block in enumerate(blocks):
    if not _RESULTS_LINK.search(block):
      continue
    chosen = [block]
    if i + 1 < len(blocks) and blocks[i + 1].lstrip().startswith("|"):
      chosen.append(blocks[i + 1])
    for part in chosen:
      part = re.sub(r"\]\([^)]*\)", "]", part)               # link targets
      part = re.sub(r"`[^`]*`", "", part)                    # code
      part = re.sub(r"\b(jax|Python|CUDA) [\d.]+", "", part)  # versions
      part = re.sub(r"\d+e-\d+|2\^-?\d+|2[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+", "", part)  # exponents
      figures += _NUMBER.findall(part)
  return figures


def _appears(figure: str, text: str) -> bool:
  variants = {figure, figure.replace(",", "")}
  return any(re.search(rf"(?<![\d.]){re.escape(v)}(?!\d)", text) for v in variants)


@pytest.mark.parametrize("page", [README] + GUIDES + [DOCS / "index.md"],
                         ids=lambda p: p.name)
def test_every_figure_quoted_beside_a_results_link_is_in_the_results(page):
  record = results_text()
  missing = [f for f in quoted_figures(read(page)) if not _appears(f, record)]
  assert not missing, (page.name, missing)


def test_the_figure_check_reads_the_readmes_tables():
  figures = quoted_figures(read(README))
  assert {"6.03", "4.03", "26.8", "0.37", "0.91"} <= set(figures)


# ---------------------------------------------------------------------------
# History stays in the record.
# ---------------------------------------------------------------------------

_HISTORY = [
    r"\b20\d\d-\d\d-\d\d\b",                   # a date
    r"\b[Ii]ssues? \d+",                       # an issue number
    r"\b[Bb]efore (this|the fix)\b",
    r"\bused to\b",
    r"\bnot yet\b|\byet\)",
    r"(?<![`\w])now(?![`\w])",
    r"\b[Pp]reviously\b|\bno longer\b",
    r"(?:^|[.(] )Before,",
]


@pytest.mark.parametrize("page", [README] + GUIDES + [DOCS / "index.md"],
                         ids=lambda p: p.name)
def test_guides_and_the_readme_hold_no_history(page):
  text = flat(re.sub(r"`[^`]*`", "", prose(read(page))))
  for pattern in _HISTORY:
    match = re.search(pattern, text)
    assert not match, (page.name, text[max(0, match.start() - 60):match.end() + 60])
