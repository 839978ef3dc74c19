"""Test set-up shared by every test module.

Two CPU devices, so that cross-device behaviour (shard_map, NamedSharding)
is exercised without a GPU. This must run before JAX initialises a backend.
"""

import os

# The CPU platform, whatever is installed (jmp_lab keeps the gpu-compile
# extra's CUDA plugin quiet without a GPU, but the tests choose the platform
# themselves). Set JAX_PLATFORMS=cuda to test on a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# CI time: most of the suite's time is XLA compiling small CPU programs, and
# LLVM's optimizations are about a quarter of that (tests/test_training.py:
# 66 s at the default level 3, 48 s at 0). The level can change which sums
# XLA:CPU contracts into FMAs, so a test that compares two different programs
# bit for bit pins level 3 for them (test_lean's PRODUCTION_LLVM). Compiles
# for an H100 (jmp_lab.diagnostics.compile_for_gpu) pin level 3 too, so the
# compiled reports are those of a production build. JMP_LAB_TEST_LLVM_O3=1
# keeps the default everywhere.
# Subprocesses that set XLA_FLAGS of their own add CPU_COMPILE_FLAGS to keep
# these choices.
LLVM_LEVEL_FLAG = ("" if os.environ.get("JMP_LAB_TEST_LLVM_O3")
                   else "--xla_backend_optimization_level=0")


def _jaxlib_before_0_11() -> bool:
  """Whether the installed jaxlib is older than 0.11 (read without importing
  jax: XLA reads XLA_FLAGS once, when its first backend starts)."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    major, minor = metadata.version("jaxlib").split(".")[:2]
  except metadata.PackageNotFoundError:
    return False
  return (int(major), int(minor)) < (0, 11)


# CI time on the floor lane: jax 0.10.2's XLA:CPU emits its fusions through
# its MLIR fusion emitters, which take about half of each small compile
# (60 small jits: 118 -> 64 ms each without them, 73 with the AVX cap below;
# a 6-layer MLP's gradient 206 -> 138 ms, 153 with the cap; the floor lane's
# tests 1,293 -> 978 s with both, 2026-11-29). Its
# older LLVM-IR emitters compute the same ops, but they let LLVM contract
# a*b+c into one FMA wherever it finds one, so two programs that compute
# the same sum in different fusions round it differently, and the tests
# that hold two programs to the same bits (a kernel and its reference, the
# flat and the tree state) would fail. Capping the instruction set at AVX
# (FMA3 arrived with AVX2) rounds every a*b+c in two steps, in every
# program alike.
# jax 0.11 and later have only the new emitters and refuse the flag (an
# unknown XLA flag aborts the process), so both are set on jaxlib < 0.11
# only. JMP_LAB_TEST_CPU_EMITTERS=default keeps XLA's defaults.
EMITTER_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_cpu_max_isa=AVX"
                 if _jaxlib_before_0_11()
                 and os.environ.get("JMP_LAB_TEST_CPU_EMITTERS") != "default"
                 else "")
CPU_COMPILE_FLAGS = f"{LLVM_LEVEL_FLAG} {EMITTER_FLAGS}".strip()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                           + CPU_COMPILE_FLAGS).strip()

# CI time: a persistent compilation cache for each test process. Many tests
# build the same small programs from fresh functions (a step per test, the
# un-jitted half of chex.variants running op by op); jax finds them in the
# cache by their HLO instead of compiling them again (tests/test_training.py:
# 92 s -> 85 s; ten test files on two workers: 384 s -> 366 s, 2026-11-29). One directory a
# process, set in jax's config rather than the environment, so no two
# processes (xdist workers, the test subprocesses) share one: jax writes an
# entry without a lock, and a process reading it half-written would warn,
# which tests that turn warnings into errors would fail on. Removed at the
# end (pytest_unconfigure). JMP_LAB_TEST_NO_XLA_CACHE=1 turns it off; a
# JAX_COMPILATION_CACHE_DIR of your own is used as it is.
_XLA_CACHE_MADE_HERE = None
if ("JAX_COMPILATION_CACHE_DIR" not in os.environ
    and not os.environ.get("JMP_LAB_TEST_NO_XLA_CACHE")):
  import tempfile  # noqa: E402
  _XLA_CACHE_MADE_HERE = tempfile.mkdtemp(prefix="jmp_lab_test_xla_cache_")

import chex  # noqa: E402
import hypothesis  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ci_lanes  # noqa: E402  (tests/ci_lanes.py)

if _XLA_CACHE_MADE_HERE is not None:
  jax.config.update("jax_compilation_cache_dir", _XLA_CACHE_MADE_HERE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run_under_xla_cpu_defaults(nodeid: str) -> None:
  """Runs the test ``nodeid`` in a fresh process with XLA:CPU's default
  emitters and instruction set (EMITTER_FLAGS off): for the few checks that
  hold two different programs to the same bits only as XLA's default
  compiler rounds them."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  env = dict(os.environ, JMP_LAB_TEST_CPU_EMITTERS="default",
             XLA_FLAGS=LLVM_LEVEL_FLAG)
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      env=env, capture_output=True, text=True, timeout=1200)
  tail = (result.stdout + result.stderr)[-4000:]
  assert result.returncode == 0 and " passed" in result.stdout, tail


# 2 CPU devices; tests/test_fsdp.py starts a process with 8.
chex.set_n_cpu_devices(int(os.environ.get("JMP_LAB_TEST_CPU_DEVICES", "2")))

# Compilation makes the first example of a property test slow; deadlines would
# only measure XLA. Derandomize in CI so a failure is reproducible from the log.
hypothesis.settings.register_profile("default", deadline=None, max_examples=50)
hypothesis.settings.register_profile(
    "ci", deadline=None, max_examples=50, derandomize=True,
    print_blob=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "default")


# ---------------------------------------------------------------------------
# Shared params and gradients. The optimizer, fused and training tests are
# chex.TestCase classes (chex.variants needs them), so these are plain
# functions that the test modules import, not pytest fixtures.
# ---------------------------------------------------------------------------

FLOAT0 = jax.dtypes.float0


def tree_bits_equal(a, b):
  chex.assert_trees_all_equal_dtypes(a, b)
  chex.assert_trees_all_equal(a, b)


def params_of(dtype, key=0, n=64):
  k1, k2 = jax.random.split(jax.random.key(key))
  return {"dense": {"w": (jax.random.normal(k1, (n,)) * 1e-2).astype(dtype),
                    "b": (jax.random.normal(k2, (3,)) * 1e-3).astype(dtype)}}


def scaled_grads_like(params, loss_scale, key):
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(key), len(leaves))
  grads = [jax.random.normal(k, x.shape) * 1e-2 for k, x in zip(keys, leaves)]
  grads = jax.tree_util.tree_unflatten(treedef, grads)
  return jax.tree_util.tree_map(
      lambda g, p: (g * loss_scale).astype(p.dtype), grads, params)


def make_params(dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"dense": {"kernel": (jax.random.normal(k1, (37, 11)) * 0.1).astype(dtype),
                    "bias": (jax.random.normal(k2, (11,)) * 0.01).astype(dtype)},
          "step": jnp.int32(3)}


def scaled_grads(params, loss_scale, step, poison=False):
  def leaf(x, salt):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return np.zeros(x.shape, FLOAT0)
    g = jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) * (step + 1) + salt)
    if poison:
      g = g.at[(0,) * x.ndim].set(jnp.nan)
    return (g * loss_scale).astype(x.dtype)
  return {"dense": {"kernel": leaf(params["dense"]["kernel"], 0.0),
                    "bias": leaf(params["dense"]["bias"], 1.0)},
          "step": leaf(params["step"], 0.0)}


# ---------------------------------------------------------------------------
# Test order for `-n 2 --dist loadfile --no-loadscope-reorder`: each worker
# takes the next file when it is free, in this order, so the longest files
# (compiles for the H100, subprocesses, examples) start first and the two
# workers finish together (longest-first scheduling). Without it xdist
# orders files by their number of tests, which put the 90-s, one-test
# distributed file last. The rest keep their collection order.
# ---------------------------------------------------------------------------

# Ordered by each file's worker time, the larger of its two lanes' (measured
# 2026-11-30 with --durations=0): test_fsdp.py, the floor lane's largest
# (its 8-device process), starts first there, and the whole-model compiles
# first on the newest lane.
LONGEST_FIRST = (
    "test_compiled_gpt2.py", "test_real_models.py", "test_fsdp.py",
    "test_block_scaled.py", "test_fp8.py", "test_docs_and_examples.py",
    "test_kernels.py", "test_sharding.py", "test_compiled.py",
    "test_quantized_moments.py", "test_losses.py", "test_reduce.py",
    "test_nnx_llm.py", "test_distributed.py", "test_nnx.py", "test_lean.py",
    "test_training.py", "test_benchmarks.py", "test_fused.py",
)


# ---------------------------------------------------------------------------
# Whole-model compiles for H100s (``model_compile``): GPT-2, the 7B-class
# Llama, the real models' steps. They are measurements of what XLA makes of
# a model, and each takes a minute or more of XLA's time; CI runs them on
# its newest-jax lane only (where XLA changes first: jax 0.12 put GEMMs in
# dynamic-slice fusions and CUDA graphs), which keeps the two lanes inside
# the hour. The GPU machines' jax 0.11.2 runs them too. JMP_LAB_MODEL_COMPILES=all
# runs them on any jax; =none skips them everywhere.
# ---------------------------------------------------------------------------

MODEL_COMPILES_FROM = (0, 11)


def _skip_model_compiles() -> str:
  """Why whole-model compiles are skipped here ("" where they run)."""
  from jmp_lab import _compat  # pylint: disable=import-outside-toplevel
  choice = os.environ.get("JMP_LAB_MODEL_COMPILES", "")
  if choice == "all":
    return ""
  if choice == "none":
    return "JMP_LAB_MODEL_COMPILES=none"
  version = tuple(int(part) for part in _compat.JAX_VERSION.split(".")[:2])
  if version < MODEL_COMPILES_FROM:
    return (f"a whole-model compile for H100s: run on jax >= "
            f"{'.'.join(map(str, MODEL_COMPILES_FROM))} (CI's newest-jax "
            f"lane); JMP_LAB_MODEL_COMPILES=all runs it on this jax "
            f"{_compat.JAX_VERSION}")
  return ""


# ---------------------------------------------------------------------------
# CI's two lanes split the heaviest groups of tests that do not need both
# jax versions to mean something (docs/development.md names them and why):
# ``floor_lane`` tests run on jax < 0.11 (CI's floor lane), ``newest_lane``
# ones on jax >= 0.11 (CI's newest lane and the GPU machines).
# JMP_LAB_LANES=all runs both groups on any jax.
# ---------------------------------------------------------------------------


# The heaviest test functions that are not marked run on the lane that
# tests/lanes.txt names (tests/ci_lanes.py says why and how it is written).
_LISTED_LANES = ci_lanes.read_lanes()


def _every_lane_runs_here() -> bool:
  """Whether JMP_LAB_LANES=all runs both lanes' tests here."""
  return os.environ.get("JMP_LAB_LANES", "") == "all"


def _this_lane_is_newest() -> bool:
  """Whether this jax is the newest lane's (jax >= 0.11) or the floor's."""
  from jmp_lab import _compat  # pylint: disable=import-outside-toplevel
  version = tuple(int(part) for part in _compat.JAX_VERSION.split(".")[:2])
  return version >= MODEL_COMPILES_FROM


def _skip_other_lane(item) -> str:
  """Why ``item`` is skipped on this jax's lane ("" where it runs)."""
  if _every_lane_runs_here():
    return ""
  from jmp_lab import _compat  # pylint: disable=import-outside-toplevel
  newest = _this_lane_is_newest()
  lane = ("floor" if item.get_closest_marker("floor_lane") else
          "newest" if item.get_closest_marker("newest_lane") else
          _LISTED_LANES.get(ci_lanes.function_key(item.nodeid)))
  if lane is None or (lane == "newest") == newest:
    return ""
  where = ("jax < 0.11 (CI's floor lane)" if lane == "floor" else
           "jax >= 0.11 (CI's newest lane)")
  return (f"CI runs it on {where} only (docs/development.md); "
          f"JMP_LAB_LANES=all runs it on this jax {_compat.JAX_VERSION}")


ONE_LANE_MARKERS = ("floor_lane", "newest_lane", "model_compile",
                    "eight_devices")


def _refuse_listed_tests_with_markers(items) -> None:
  """A test in tests/lanes.txt that also carries a lane marker would follow
  the marker, and a listing that disagreed with it could leave the test on
  no lane at all: refuse the pair by name."""
  both = sorted({ci_lanes.function_key(item.nodeid) for item in items
                 if ci_lanes.function_key(item.nodeid) in _LISTED_LANES
                 and any(item.get_closest_marker(name)
                         for name in ONE_LANE_MARKERS)})
  if both:
    raise pytest.UsageError(
        f"tests/lanes.txt lists tests that carry a lane marker "
        f"({', '.join(ONE_LANE_MARKERS)}) of their own: {both}; take them "
        f"out of the file (.ci/assign_lanes.py leaves marked tests alone)")


def pytest_collection_modifyitems(items):
  _refuse_listed_tests_with_markers(items)
  reason = _skip_model_compiles()
  for item in items:
    if reason and item.get_closest_marker("model_compile"):
      item.add_marker(pytest.mark.skip(reason=reason))
    lane_reason = _skip_other_lane(item)
    if lane_reason:
      item.add_marker(pytest.mark.skip(reason=lane_reason))

  def rank(item):
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(
        LONGEST_FIRST)
  items.sort(key=rank)  # stable: within a file, the collection order


# Whether each function tests/lanes.txt gives to this jax's lane ran a case
# here: one that skipped every case (say, a backend this jax lacks) would
# run on no lane at all.
_LISTED_OUTCOMES: dict = {}


def pytest_runtest_logreport(report):
  key = ci_lanes.function_key(report.nodeid)
  if key in _LISTED_LANES and (report.when == "call" or report.skipped):
    _LISTED_OUTCOMES.setdefault(key, set()).add(
        "skipped" if report.skipped else "ran")


def pytest_sessionfinish(session, exitstatus):
  """In CI (``CI`` set), fails a run in which a function listed for this
  lane skipped every case it collected; elsewhere only says so. An
  xdist worker's reports reach the controller, which checks them all."""
  del exitstatus
  if hasattr(session.config, "workerinput") or _every_lane_runs_here():
    return
  here = "newest" if _this_lane_is_newest() else "floor"
  never = sorted(key for key, outcomes in _LISTED_OUTCOMES.items()
                 if outcomes == {"skipped"} and _LISTED_LANES[key] == here)
  if not never:
    return
  message = (f"tests/lanes.txt gives these to the {here} lane, where every "
             f"case skipped, so no lane runs them: {never}")
  reporter = session.config.pluginmanager.get_plugin("terminalreporter")
  if reporter is not None:
    reporter.ensure_newline()
    reporter.write_line(message, red=True)
  if os.environ.get("CI"):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
  """Removes the compilation cache this process made."""
  del config
  if _XLA_CACHE_MADE_HERE is not None:
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(_XLA_CACHE_MADE_HERE, ignore_errors=True)
