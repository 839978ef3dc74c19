"""Compiled for an H100 on every CI run, without a GPU.

XLA's GPU compiler (the CUDA plugin, from the gpu-compile extra) compiles the
Pallas kernels and whole train steps for sm_90a; these tests read the
compiled modules: spills, registers, GEMM dtypes, collectives, bytes.
"""

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lab
from jmp_lab._src import cuda_plugin
from jmp_lab.diagnostics import _walk, compiled, hlo
from jmp_lab.kernels import multi_tensor
from jmp_lab.kernels.reference import AdamWConfig

from cuda_compile import require_cuda_plugin

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import train_step  # noqa: E402

SDS = jax.ShapeDtypeStruct


# --- the HLO reader --------------------------------------------------------

HLO = """
%fused_mul (p0: f32[64,32]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %m = f32[64,32]{1,0} multiply(%p0, %p0)
}

ENTRY %main.3 (a.1: bf16[64,128], b.1: bf16[128,32]) -> (f32[64,32], bf16[64,32]) {
  %a.1 = bf16[64,128]{1,0} parameter(0)
  %b.1 = bf16[128,32]{1,0} parameter(1)
  %custom-call.1 = (bf16[64,32]{1,0}, s8[4096]{0}) custom-call(%a.1, %b.1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]}}}
  %get-tuple-element.1 = bf16[64,32]{1,0} get-tuple-element(%custom-call.1), index=0
  %convert = f32[64,32]{1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_mul
  %all-reduce-start = f32[64,32]{1,0} all-reduce-start(%convert), replica_groups={}, to_apply=%add
  %all-reduce-done = f32[64,32]{1,0} all-reduce-done(%all-reduce-start)
  ROOT %tuple = (f32[64,32]{1,0}, bf16[64,32]{1,0}) tuple(%all-reduce-done, %get-tuple-element.1)
}
"""


def test_hlo_reader_resolves_shapes_operands_and_configs():
  module = hlo.parse_module(HLO)
  entry = module.entry
  assert entry.name == "main.3" and "fused_mul" in module.computations
  gemm = next(i for i in entry.instructions if i.opcode == "custom-call")
  assert [str(a) for a in gemm.result] == ["bf16[64,32]", "s8[4096]"]
  assert [str(t[0]) for t in gemm.operand_types] == ["bf16[64,128]", "bf16[128,32]"]
  assert gemm.attribute("custom_call_target") == "__cublas$lt$matmul"
  assert gemm.backend_config()["gemm_backend_config"]["dot_dimension_numbers"][
      "lhs_contracting_dimensions"] == ["1"]
  assert gemm.operand_bytes == 64 * 128 * 2 + 128 * 32 * 2


def test_walker_counts_kernels_gemms_collectives_and_custom_call_bytes():
  walker = _walk.Walker(hlo.parse_module(HLO))
  walker.walk(walker.module.entry, 1)
  assert walker.kernels == 3  # cuBLAS, the fusion, the all-reduce
  (gemm,) = walker.gemms
  assert (gemm.kind, gemm.operands, gemm.math) == ("cublas", "bf16 x bf16 -> bf16", "16-bit")
  assert gemm.flops == 2 * 64 * 32 * 128
  # The cuBLAS workspace is scratch: only the operands and the product count.
  assert walker.custom_call_bytes == 64 * 128 * 2 + 128 * 32 * 2 + 64 * 32 * 2
  (reduce,) = walker.collectives
  assert (reduce.kind, reduce.dtypes, reduce.bytes) == ("all-reduce", ("f32",), 64 * 32 * 4)


def test_a_combined_collective_counts_every_operand():
  """XLA combines many gradients into one variadic reduce-scatter (or
  all-reduce): every operand is moved, not only the first."""
  text = """
ENTRY %main (a: f32[256], b: bf16[64,8], c: f32[512]) -> (f32[32], bf16[8,8], f32[64]) {
  %a = f32[256]{0} parameter(0)
  %b = bf16[64,8]{1,0} parameter(1)
  %c = f32[512]{0} parameter(2)
  %rs = ((f32[256]{0}, bf16[64,8]{1,0}, f32[512]{0}), (f32[32]{0}, bf16[8,8]{1,0}, f32[64]{0})) reduce-scatter-start(%a, %b, %c), replica_groups={}, dimensions={0}, to_apply=%add
  ROOT %done = (f32[32]{0}, bf16[8,8]{1,0}, f32[64]{0}) reduce-scatter-done(%rs)
}
"""
  walker = _walk.Walker(hlo.parse_module(text))
  walker.walk(walker.module.entry, 1)
  (scatter,) = walker.collectives
  assert scatter.kind == "reduce-scatter"
  assert scatter.dtypes == ("bf16", "f32")
  assert scatter.bytes == 256 * 4 + 64 * 8 * 2 + 512 * 4


# --- targets and errors ----------------------------------------------------


def test_targets_ship_with_the_package():
  h100, h200 = compiled.gpu_target("h100"), compiled.gpu_target("H200")
  assert h100.memory_bandwidth == 3.35232e12 and h200.memory_bandwidth == 4.8e12
  assert "core_count: 132" in h100.config
  assert compiled.gpu_target(h100.config).name == "custom"


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: compiled.gpu_target("h300"), ValueError, "unknown target 'h300'.*h100"),
    (lambda: compiled.gpu_target(100), TypeError, "target must be"),
    (lambda: compiled.gpu_mesh("h100", devices=0), ValueError, "devices must be an int >= 1, got 0"),
])
def test_bad_arguments_are_named(call, error, pattern):
  with pytest.raises(error, match=pattern):
    call()


def test_missing_plugin_says_what_to_install(monkeypatch):
  def version(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "version", version)
  with pytest.raises(RuntimeError, match=r"jmp_lab\[gpu-compile\].*cuda12-local"):
    compiled.gpu_mesh("h100")


PERSISTENT_CACHE_RUN = """
import os, warnings
import jax, jax.numpy as jnp, jmp_lab
warnings.simplefilter("always")
cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
jax.jit(lambda x: x * 2 + 1)(jnp.arange(5.0)).block_until_ready()  # CPU first
cpu_entries = len(os.listdir(cache))
h = jax.ShapeDtypeStruct((96, 96), jnp.bfloat16)
with warnings.catch_warnings(record=True) as caught:
  for _ in range(2):
    jmp_lab.diagnostics.compile_for_gpu(lambda a, b: (a @ b) * 3, h, h)
jax.jit(lambda x: x * 5 - 2)(jnp.arange(5.0)).block_until_ready()  # CPU again
print("RESULT", cpu_entries, len(os.listdir(cache)),
      sum("compilation cache" in str(w.message) for w in caught))
"""


def test_compiles_for_a_gpu_leave_the_persistent_cache_alone(tmp_path):
  """With jax's persistent compilation cache on (as many users have it), a
  compile for an H100 without a GPU writes nothing there, and the cache
  keeps working for CPU programs: an executable for an abstract GPU cannot
  be read back, and a second compile of the same program warned "Error
  reading persistent compilation cache entry" before. (In a process of its
  own: jax turns the cache on or off once per process, at its first
  compile.)"""
  require_cuda_plugin()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  run = subprocess.run([sys.executable, "-c", PERSISTENT_CACHE_RUN],
                       capture_output=True, text=True, env=env, timeout=600,
                       check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  line = next(l for l in run.stdout.splitlines() if l.startswith("RESULT"))
  cpu_entries, entries, warned = map(int, line.split()[1:])
  assert cpu_entries >= 1          # the cache is on for CPU programs
  assert warned == 0
  assert entries == cpu_entries + 1  # the second CPU program, no GPU one


# --- the gpu-compile extra stays quiet without a GPU ---------------------------

QUIET_RUN = """
import jax, jax.numpy as jnp, jmp_lab
assert float(jnp.ones(3).sum()) == 3.0   # jax has started its backend
h = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
text = jmp_lab.diagnostics.compile_for_gpu(lambda a, b: a @ b, h, h).as_text()
print(jax.default_backend(), "__cublas$lt$matmul" in text)
"""


def test_without_a_gpu_jax_starts_quietly_and_still_compiles_for_an_h100():
  """Before the fix: jax's start printed "Jax plugin configuration error ...
  Unable to load CUDA", and the compile failed without JAX_PLATFORMS=cpu."""
  require_cuda_plugin()
  if cuda_plugin.gpu_may_be_present():
    pytest.skip("an NVIDIA GPU may be present: jax's own check stays on")
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", cuda_plugin.SKIP_CHECK)}
  run = subprocess.run([sys.executable, "-c", QUIET_RUN], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "plugin configuration error" not in run.stderr.lower(), run.stderr
  assert "Unable to load CUDA" not in run.stderr, run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  assert run.stdout.split() == ["cpu", "True"]


def test_import_jmp_lab_prints_nothing_without_a_gpu():
  """Before the fix: every ``import jmp_lab`` with the gpu-compile extra
  printed the CUDA plugin's "Could not find cuda drivers on your machine"
  (twice on jax 0.12, three times on 0.10.2), each after absl's notice."""
  require_cuda_plugin()
  if cuda_plugin.gpu_may_be_present():
    pytest.skip("an NVIDIA GPU may be present: nothing is quieted")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  run = subprocess.run([sys.executable, "-c", "import jmp_lab"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stderr == "" and run.stdout == ""


def test_the_quieted_import_keeps_every_other_line_of_stderr(capfd):
  noise = ("WARNING: All log messages before absl::InitializeLog() is called "
           "are written to STDERR\n"
           "I0000 00:00:1795839113.004761   12115 cudart_stub.cc:31] Could not "
           "find cuda drivers on your machine, GPU will not be used.\n")
  with cuda_plugin.stderr_without(cuda_plugin.NO_DRIVER_NOISE):
    os.write(2, (noise + "a real warning\n" + noise + "another\n").encode())
  assert capfd.readouterr().err == "a real warning\nanother\n"


@pytest.mark.parametrize("environ, installed, gpu, platforms, acts", [
    ({}, True, False, None, True),
    ({"JAX_PLATFORMS": "cpu"}, True, False, None, False),   # chosen by env
    ({}, True, False, "cuda", False),          # chosen by jax.config.update
    ({}, True, True, None, False),             # a GPU may be here: jax's check
    ({}, False, False, None, False),           # no CUDA plugin: nothing to do
    ({cuda_plugin.SKIP_CHECK: ""}, True, False, None, False),  # the user's own
])
def test_the_cuda_check_is_turned_off_only_where_it_can_only_fail(
    environ, installed, gpu, platforms, acts):
  before = dict(environ)
  assert cuda_plugin.quiet_without_gpu(
      environ, installed=lambda: installed, gpu=lambda: gpu,
      platforms=lambda: platforms) is acts
  assert environ == ({**before, cuda_plugin.SKIP_CHECK: "1"} if acts
                     else before)


# --- small functions: GEMM math and the byte model ----------------------------


@pytest.mark.parametrize("dtype, precision, math", [
    (jnp.bfloat16, "default", "16-bit"),
    (jnp.float16, "default", "16-bit"),
    (jnp.float32, "default", "tf32"),
    (jnp.float32, "highest", "fp32"),
])
def test_gemm_math_follows_dtype_and_precision(dtype, precision, math):
  a = SDS((256, 512), dtype)
  with jax.default_matmul_precision(precision):
    report = compiled.compiled_report(lambda x, y: x @ y.T, a, a)
  (gemm,) = report.gemms
  assert (gemm.kind, gemm.math, gemm.flops) == ("cublas", math, 2 * 256 * 256 * 512)
  assert report.fp32_gemms == ([] if math == "16-bit" else [gemm])


def test_byte_model_of_one_elementwise_kernel_is_exact():
  """y = 2x + 1 over 1M floats: one kernel, 4 B read and 4 B written each."""
  x = SDS((2**20,), jnp.float32)
  report = compiled.compiled_report(lambda x: 2 * x + 1, x)
  assert report.kernels == 1
  assert report.bytes_accessed == report.kernel_io_bytes == 8 * 2**20
  assert report.roofline_seconds()["memory"] == pytest.approx(8 * 2**20 / 3.35232e12)


def test_a_kernel_without_gemms_costs_its_bytes_in_both_rooflines():
  report = compiled.compiled_report(lambda x: 2 * x + 1,
                                    SDS((2**20,), jnp.float32))
  roof = report.roofline_seconds()
  assert roof["overlapped"] == roof["total"] == roof["memory"]


@pytest.mark.parametrize("rows, bound", [(4096, "math"), (8, "bytes")])
def test_the_overlapped_roofline_hides_a_gemms_lesser_cost(rows, bound):
  """One cuBLAS GEMM, (rows, 4096) x (4096, 4096) in bf16 on an H100: at
  4096 rows its math (137 GFLOP, 139 us) outlasts its 100 MB (30 us); at
  8 rows its 34 MB (10 us) outlast its math (0.3 us). The summed roofline
  pays both, the overlapped one the larger."""
  a, w = SDS((rows, 4096), jnp.bfloat16), SDS((4096, 4096), jnp.bfloat16)
  report = compiled.compiled_report(jnp.matmul, a, w)
  (gemm,) = report.gemms
  assert gemm.io_bytes == a.size * 2 + w.size * 2 + rows * 4096 * 2
  assert gemm.kernel in {k.name for k in report.kernel_records}
  roof = report.roofline_seconds()
  bytes_seconds = gemm.io_bytes / report.target.memory_bandwidth
  assert roof["total"] == pytest.approx(roof["memory"] + roof["gemm"])
  assert roof["memory"] == pytest.approx(bytes_seconds, rel=1e-6)
  expected = roof["gemm"] if bound == "math" else bytes_seconds
  assert roof["overlapped"] == pytest.approx(expected, rel=1e-6)
  assert roof["overlapped"] == pytest.approx(
      max(roof["gemm"], bytes_seconds), rel=1e-6)


def test_the_overlapped_roofline_hides_the_bytes_of_triton_gemm_fusions():
  """Two compute-bound GEMMs as XLA's Triton fusions (their dots inside
  fusion kernels): each kernel's boundary bytes hide under its math."""
  a = SDS((4096, 4096), jnp.bfloat16)
  report = compiled.compiled_report(lambda x, y: jnp.tanh(x @ y) @ y, a, a,
                                    triton_gemm=True)
  assert {g.kind for g in report.gemms} == {"triton"}
  assert len({g.kernel for g in report.gemms}) == 2
  roof = report.roofline_seconds()
  hidden = sum(g.io_bytes for g in report.gemms) / (
      report.target.memory_bandwidth)
  assert roof["gemm"] <= roof["overlapped"] < roof["total"]
  assert roof["overlapped"] == pytest.approx(roof["total"] - hidden,
                                             rel=1e-6)


def test_the_overlapped_roofline_counts_every_trip_of_a_looped_gemm():
  """A compute-bound GEMM in a 3-trip scan: three launches, each hiding its
  bytes under its math; the tanh between them costs its bytes."""
  w = SDS((2048, 2048), jnp.bfloat16)

  def scanned(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None,
                        length=3)[0]

  report = compiled.compiled_report(scanned, w, w)
  assert sum(g.times for g in report.gemms) == 3
  roof = report.roofline_seconds()
  gemm_bytes = sum(g.io_bytes * g.times for g in report.gemms)
  rest = roof["memory"] - gemm_bytes / report.target.memory_bandwidth
  assert rest > 0
  assert roof["overlapped"] == pytest.approx(roof["gemm"] + rest, rel=1e-6)


@pytest.mark.parametrize("trips", [1, 2, 10])
def test_byte_model_counts_every_trip_of_a_loop(trips):
  """XLA's cost analysis counts a while body once (2 and 10 trips gave the
  same bytes); each trip reads and writes the 4 MiB carry."""
  def scanned(x):
    return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None,
                        length=trips)[0]

  report = compiled.compiled_report(scanned, SDS((1024, 1024), jnp.float32))
  assert report.bytes_accessed >= trips * 8 * 2**20
  assert report.bytes_accessed == pytest.approx(report.kernel_io_bytes,
                                                rel=0.01)


@pytest.mark.parametrize("installed, ok", [
    ({"jax-cuda12-plugin": jax.__version__}, "jax-cuda12-plugin"),
    ({"jax-cuda13-plugin": jax.__version__}, "jax-cuda13-plugin"),
    ({"jax-cuda12-plugin": "0.0.1", "jax-cuda13-plugin": jax.__version__},
     "jax-cuda13-plugin"),
    ({"jax-cuda12-plugin": "0.0.1"}, None),
    ({}, None),
])
def test_either_cuda_plugin_matched_to_jax_is_accepted(monkeypatch, installed,
                                                       ok):
  import importlib.metadata

  def version(name):
    if name not in installed:
      raise importlib.metadata.PackageNotFoundError(name)
    return installed[name]

  monkeypatch.setattr(importlib.metadata, "version", version)
  if ok:
    assert compiled.cuda_plugin() == (ok, jax.__version__)
  else:
    with pytest.raises(RuntimeError, match="jmp_lab\\[gpu-compile\\]"):
      compiled.cuda_plugin()


def test_host_launches_count_a_cuda_graph_once():
  """A run of small kernels (at least a reduction and a division for each
  of six normalisations: twelve on jax 0.10's XLA, fourteen on jax 0.12's),
  then a cuBLAS GEMM and its epilogue: XLA records the run into one command
  buffer (a CUDA graph, one launch from the host). jax 0.10's XLA launches
  the GEMM and the kernel after it itself; jax 0.12's records them too."""
  def normalise_then_project(x, w):
    for _ in range(6):
      x = x / jnp.sum(x, axis=0, keepdims=True)
    return jnp.tanh(x @ w)

  x = SDS((256, 256), jnp.bfloat16)
  report = compiled.compiled_report(normalise_then_project, x, x)
  graphed = [t for t in report.thunks if t.graph is not None
             and t.kind != "kCommandBuffer"]
  assert len(graphed) >= 12 and len({t.graph for t in graphed}) == 1
  gemm = [t for t in report.thunks if t.kind == "kCublasLtMatmul"]
  assert len(gemm) == 1 and gemm[0].instruction in report.hlo_text
  if gemm[0].graph is None:   # launched by XLA: the GEMM and its epilogue
    assert report.kernels == len(graphed) + 2
    assert report.host_launches() == 3
  else:                       # recorded in the one graph with the rest
    assert report.kernels == len(graphed)
    assert report.host_launches() == 1
  # By scope: the instructions XLA put in the graph count as one launch.
  assert report.host_launches({t.instruction for t in graphed[:5]}) == 1


def test_byte_model_counts_a_sliced_operand_as_the_slices_read():
  """Four kernels, each reading a quarter of one buffer: 8 B per element in
  all, not four whole-buffer reads (which gave 20)."""
  n = 2**22
  report = compiled.compiled_report(
      lambda f: [f[i * n // 4:(i + 1) * n // 4] + 1 for i in range(4)],
      SDS((n,), jnp.float32))
  assert report.kernels == 4
  assert report.kernel_io_bytes == 8 * n
  assert report.bytes_accessed == pytest.approx(8 * n, abs=64)  # + the constant 1


# --- the Pallas kernels, compiled for sm_90a ----------------------------------


@pytest.mark.parametrize("keep_master", [True, False])
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_pallas_kernel_compiles_for_sm90a_without_spills(backend, keep_master):
  rows = 132 * 8 * 4
  config = AdamWConfig(0.9, 0.999, 1e-8, 1e-4,
                       np.dtype(jnp.bfloat16) if keep_master else None)
  args = ((SDS((rows, 256), jnp.bfloat16),)
          + tuple(SDS((rows, 256), jnp.float32) for _ in range(3))
          + (SDS((5,), jnp.float32), SDS((2,), jnp.int32)))
  report = compiled.compiled_report(
      lambda *a: jmp_lab.kernels.fused_update(backend, config, *a), *args,
      donate_argnums=(1, 2, 3), fail_on_spill=True)
  (kernel,) = report.pallas_kernels
  assert kernel.backend == backend
  assert kernel.spill_bytes == 0
  assert 32 <= kernel.registers <= 128  # measured: triton 78, mosaic 116
  # The kernel reads g, p, m, v and writes p, m, v and the extra output.
  elements = rows * 256
  assert report.custom_call_bytes >= elements * (2 + 12 + 12 + (2 if keep_master else 4))


@pytest.mark.floor_lane  # jax 0.10.2 has both Pallas GPU backends
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_pallas_update_compiles_for_a_b200_without_spills(backend):
  """Blackwell (sm_100a): the fused update's kernel compiles as on Hopper,
  without spills (the B200's block-scaled steps use the same backends)."""
  require_cuda_plugin()
  rows = 132 * 8 * 4
  config = AdamWConfig(0.9, 0.999, 1e-8, 1e-4, np.dtype(jnp.bfloat16))
  args = ((SDS((rows, 256), jnp.bfloat16),)
          + tuple(SDS((rows, 256), jnp.float32) for _ in range(3))
          + (SDS((5,), jnp.float32), SDS((2,), jnp.int32)))
  report = compiled.compiled_report(
      lambda *a: jmp_lab.kernels.fused_update(backend, config, *a), *args,
      donate_argnums=(1, 2, 3), fail_on_spill=True, target="b200")
  (kernel,) = report.pallas_kernels
  assert kernel.backend == backend
  if backend == "triton":   # ptxas run again on the kept PTX, for sm_100a
    assert kernel.spill_bytes == 0 and kernel.registers > 0
  else:   # Mosaic's own ptxas log, where this compile wrote one (a kernel
    # Mosaic compiled earlier in the process writes none)
    assert kernel.spill_bytes in (0, None)
  assert "sm_100a" in report.table()


# Per mode: (param dtype, master, moment dtype) and the update kernel's bytes
# per param: g + state read, state + params written.
MULTI_TENSOR_MODES = {
    "fp32-master": (jnp.bfloat16, "float32", jnp.float32, 2 + 12 + 12 + 2),
    "fp32-params": (jnp.float32, "float32", jnp.float32, 4 + 12 + 12),
    # g 2 + params 2 + remainder 2 + m, v 4 read; remainder 2 + m, v 4 +
    # params 2 written.
    "remainder-bf16-moments": (jnp.bfloat16, "remainder", jnp.bfloat16,
                               2 + 2 + 2 + 4 + 2 + 4 + 2),
    # g 2 + params 2 + m, v 4 read; params 2 + m, v 4 written (and a hash
    # per element, which costs registers, not bytes).
    "none-stochastic-bf16-moments": (jnp.bfloat16, "none", jnp.bfloat16,
                                     2 + 2 + 4 + 2 + 4),
}


@pytest.mark.parametrize("mode", sorted(MULTI_TENSOR_MODES))
def test_multi_tensor_kernels_compile_for_sm90a_in_place(mode):
  """20 leaves of uneven size (two launches of each kernel): no spills, and
  the update reads and writes only what the mode keeps, in place, after a
  statistics pass that reads the gradients once (2 B/param in bf16). The
  budget of each mode is stated next to the kernel (kernels.multi_tensor)."""
  dtype, master, moments, update_bytes = MULTI_TENSOR_MODES[mode]
  keep_master = dtype != jnp.float32
  remainder, direct = master == "remainder", master == "none"
  sizes = [3000 + 4099 * i for i in range(20)]
  config = AdamWConfig(0.9, 0.999, 1e-8, 1e-4,
                       np.dtype(dtype) if keep_master else None,
                       remainder=remainder, direct=direct, stochastic=direct)

  def step(g, p, mu, nu, rem):
    hyper = jnp.array([1e-3, 1.0, 1.0, 8.0, 1.0], jnp.float32)
    _, finite = multi_tensor.grad_stats(g, hyper[3], interpret=False)
    flags = jnp.stack([finite.astype(jnp.int32), jnp.int32(0), jnp.int32(7)])
    out = multi_tensor.update(config, [True] * len(g), g, p, mu, nu, hyper,
                              flags, write_extra=keep_master, interpret=False,
                              remainders=rem if remainder else None)
    # In the inputs' order: jax pairs donated inputs with outputs by shape
    # and dtype, first come first served (bf16 params and bf16 moments alike).
    if remainder:
      return out.extra, out.mu, out.nu, out.master
    return out.master, out.mu, out.nu, out.extra

  leaves = lambda dtype: [SDS((n,), dtype) for n in sizes]  # noqa: E731
  state_dtype = dtype if remainder or direct else jnp.float32
  report = compiled.compiled_report(
      step, leaves(dtype), leaves(state_dtype), leaves(moments),
      leaves(moments), leaves(jnp.uint16), donate_argnums=(1, 2, 3, 4),
      fail_on_spill=True)
  assert len(report.pallas_kernels) == 4  # 2 launches x 2 kernels
  assert all(k.spill_bytes == 0 and k.backend == "triton"
             for k in report.pallas_kernels)
  summary = report.pallas_summary()
  assert "jmp_lab_grad_stats x2 (triton" in summary, summary
  assert "jmp_lab_multi_tensor_adamw x2 (triton" in summary, summary
  n = sum(sizes)
  # Copies would show as bytes beyond the kernels' own (donated in place).
  assert report.custom_call_bytes == pytest.approx(
      n * (np.dtype(dtype).itemsize + update_bytes), rel=0.01)
  assert report.memory.get("temp", 0) < 0.01 * n * 4


def test_triton_gemm_fusions_are_found_with_their_dtypes():
  """With triton_gemm=True XLA emits GEMMs as Triton fusions; the dot inside
  is found and reported like a cuBLAS call."""
  a = SDS((256, 512), jnp.bfloat16)
  report = compiled.compiled_report(lambda x, y: (x @ y.T).astype(jnp.float32),
                                    a, a, triton_gemm=True)
  kinds = {(g.kind, g.lhs.dtype, g.rhs.dtype) for g in report.gemms}
  assert kinds == {("triton", "bf16", "bf16")}, kinds
  assert report.gemm_flops == 2 * 256 * 256 * 512


# --- issue 13: memory-lean masters, compiled for an H100 ----------------------


def test_lean_master_modes_shrink_the_step_arguments_on_h100():
  """Argument bytes of the donated step (params + optimizer state + batch),
  small 1-layer model: each mode saves what it stores less of, 2 B/param a step
  (fp32 master 4 -> remainder 2 -> none 0; fp32 -> bf16 moments), in both
  optimizers (the fused ones with bf16 mu and nu: 14 -> 8 -> 6 B/param).

  The arguments are the state's arrays, whatever the target, so each mode's
  are counted from its abstract state; the leanest mode's step, compiled for
  the H100, takes exactly that many bytes (one compile: seven took 90 s)."""
  # A small GPT: the saving per param does not depend on the size.
  size = train_step.ModelSize(layers=1, width=256, heads=4, seq_len=128,
                              vocab=4096, batch=8)
  params = train_step.param_count(size)
  base = next(c for c in train_step.CONFIGS if c.name == "bf16-o2")
  batch_bytes = size.batch * (size.seq_len + 1) * 4

  def argument_bytes(config):
    state = jax.eval_shape(lambda: train_step.make_state(config, size))
    return batch_bytes + sum(x.size * x.dtype.itemsize
                             for x in jax.tree_util.tree_leaves(state))

  args = {c.name: argument_bytes(c) for c in [base] + train_step.LEAN_CONFIGS}
  leanest = train_step.LEAN_CONFIGS[-1]
  assert leanest.name == "bf16-o2+fused-none-sr-m16v16"
  compiled = train_step.compiled_step_report(leanest, size, "h100")
  # jit drops the arguments a step never reads: the one-byte
  # last_step_applied flag (written by the step, not read).
  assert args[leanest.name] - compiled.memory["argument"] == 1
  saved = {name: (args["bf16-o2"] - value) / params for name, value in args.items()}
  print({k: round(v, 3) for k, v in saved.items()})
  assert saved["bf16-o2-remainder"] == pytest.approx(2, abs=0.01)
  assert saved["bf16-o2-remainder-mu16"] == pytest.approx(4, abs=0.01)
  assert saved["bf16-o2-none-sr"] == pytest.approx(4, abs=0.01)
  assert saved["bf16-o2-none-sr-mu16"] == pytest.approx(6, abs=0.01)
  assert saved["bf16-o2+fused-remainder-m16v16"] == pytest.approx(6, abs=0.01)
  assert saved["bf16-o2+fused-none-sr-m16v16"] == pytest.approx(8, abs=0.01)


def test_the_step_compiles_to_the_program_xlas_autotuner_would_choose(
    monkeypatch):
  """compile_for_gpu turns XLA's fusion autotuner off (nothing can be timed
  without a device; jax 0.12's XLA spends a third or more of a compile on
  configs it cannot time). The program must be the one the autotuner leaves: the
  same kernels, bytes and memory. A small GPT step: reductions, transposes,
  GEMMs and the update's fusions, what the autotuner tries configs for."""
  size = train_step.ModelSize(layers=1, width=128, heads=2, seq_len=64,
                              vocab=512, batch=2)
  config = next(c for c in train_step.CONFIGS if c.name == "bf16-o2")
  skipped = train_step.compiled_step_report(config, size, "h100")
  real_compile = jax.stages.Lowered.compile

  def autotuned(self, compiler_options=None, **kwargs):
    options = dict(compiler_options or {})
    assert options.pop("xla_gpu_experimental_enable_fusion_autotuner") is False
    return real_compile(self, compiler_options=options, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", autotuned)
  tuned = train_step.compiled_step_report(config, size, "h100")
  kernels = lambda r: sorted((k.name, k.opcode, k.io_bytes, k.times)  # noqa: E731
                             for k in r.kernel_records)
  assert kernels(skipped) == kernels(tuned)
  assert skipped.bytes_accessed == tuned.bytes_accessed
  assert skipped.memory == tuned.memory
  assert [g.operands for g in skipped.gemms] == [g.operands for g in tuned.gemms]


def test_a_spilling_kernel_is_named_with_the_way_out(monkeypatch):
  """A small fp32 GPT step whose XLA reduction fusion spills registers on
  the H100 (it did with jax 0.10.2): the error names the kernel and
  fail_on_spill=False, which then compiles it."""
  from benchmarks import train_step as gpt
  size = gpt.ModelSize(layers=1, width=256, heads=4, seq_len=1024,
                       vocab=8192, batch=4)
  config = next(c for c in gpt.CONFIGS if c.name == "fp32-highest")
  with jax.default_matmul_precision("highest"):
    state = jax.eval_shape(lambda: gpt.make_state(config, size))
    batch = SDS((4, 1025), jnp.int32)
    step = jmp_lab.make_train_step(gpt.loss_fn)
    with pytest.raises(RuntimeError, match=r"XLA's kernels? \w*fusion\w* "
                       r"spills? registers.*fail_on_spill=False"):
      compiled.compiled_report(step, state, batch)
    # The retry takes the compile that named the kernel: no third compile.
    compiles = []
    real_compile = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, *a, **k: compiles.append(1) or
                        real_compile(self, *a, **k))
    report = compiled.compiled_report(step, state, batch, fail_on_spill=False)
    assert not compiles
    assert report.kernels > 100
    # The kept compile's dumps came along: its thunk sequence, one in the
    # retry's own dump folder (two would read as none).
    assert report.thunks
