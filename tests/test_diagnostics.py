"""Tests for jmp_lab.diagnostics."""


import dataclasses
import math

import chex
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lab
from jmp_lab import diagnostics as dg
from jmp_lab import linen as jl
from jmp_lab.diagnostics import audit_step
from jax.sharding import PartitionSpec as P


# --- gradient histogram ----------------------------------------------------


def constructed_grads():
  return {"a": jnp.array([2.0**-30, 2.0**-20, -(2.0**-10), 1.0, 0.0, jnp.inf]),
          "b": jnp.array([3.0, 60000.0], jnp.float32),
          "step": jnp.int32(5)}


def test_histogram_counts_on_constructed_input():
  hist = dg.gradient_histogram(constructed_grads())
  assert hist.zeros == 1 and hist.non_finite == 1 and hist.nonzero == 6
  nonempty = {int(e): int(c) for e, c in zip(hist.exponents, hist.total) if c}
  assert nonempty == {-30: 1, -20: 1, -10: 1, 0: 1, 1: 1, 15: 1}
  assert hist.per_leaf["['a']"].sum() == 4 and hist.per_leaf["['b']"].sum() == 2
  assert "['step']" not in hist.per_leaf
  assert hist.smallest == 2.0**-30 and hist.largest == 60000.0


def test_exact_powers_of_two_land_in_their_own_bucket():
  values = jnp.array([2.0**k for k in range(-24, 16)] +
                     [2.0**k * 1.999 for k in range(-24, 15)])
  hist = dg.gradient_histogram({"g": values})
  for k in range(-24, 15):
    assert hist.total[hist.exponents == k][0] == 2, k


def test_shares_at_a_loss_scale():
  hist = dg.gradient_histogram(constructed_grads())
  assert hist.share_underflowing(1.0) == pytest.approx(1 / 6)   # 2^-30
  assert hist.share_subnormal(1.0) == pytest.approx(1 / 6)      # 2^-20
  assert hist.share_overflowing(1.0) == 0
  assert hist.share_overflowing(2.0) == pytest.approx(1 / 6)    # 60000 * 2
  assert hist.share_underflowing(2.0**10) == 0                  # 2^-20 now
  assert hist.share_underflowing(1.0, dg.BF16) == 0
  low, high = hist.safe_scales()
  assert low == pytest.approx(2.0**-24 / 2.0**-30)
  assert high == pytest.approx(65504 / 60000)
  assert low > high  # no single fp16 scale fits both ends


def test_histogram_plot_returns_a_figure(tmp_path):
  fig = dg.plot_gradient_histogram(dg.gradient_histogram(constructed_grads()),
                                   loss_scale=1024.0)
  fig.savefig(tmp_path / "h.png")
  assert (tmp_path / "h.png").stat().st_size > 5000


# --- step audit ------------------------------------------------------------


class Mixed(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(16, (3, 3))(x).reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(64, name="body")(x))
    x = nn.relu(nn.Dense(64, name="planted_fp32")(x))
    return nn.Dense(10, name="head")(x)  # 10 outputs: not a multiple of 8


def audited_step(path_overrides):
  policy = jmp_lab.get_policy("mixed_bfloat16")
  model = jl.with_policy(Mixed(), policy, path_overrides=path_overrides)
  x = jnp.ones((32, 8, 8, 1))
  params = model.init(jax.random.key(0), x)["params"]

  def step(params, x):
    return jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)

  return dg.audit_step(step, params, x, policy=policy)


def test_audit_finds_planted_fp32_matmul_and_odd_dimension():
  report = audited_step({"^planted_fp32$": "float32"})
  kinds = {r.kind for r in report.matmuls}
  assert kinds == {"dot_general", "conv"}
  planted = report.fp32_could_be_half
  assert planted, report.table()
  assert all(r.operand_dtypes == ("float32", "float32") for r in planted)
  # forward + two backward matmuls of the planted layer, each 32x64x64 work
  assert {r.flops for r in planted} == {2.0 * 32 * 64 * 64}
  odd = report.off_tensor_core
  assert any("N" in r.odd_dims and 10 in r.out_shape for r in odd)
  assert 0.5 < report.half_flop_share < 1.0
  assert report.num_casts > 0 and report.hlo_converts > 0
  assert "could be half" in report.table()


def test_audit_of_a_clean_bf16_model_flags_no_fp32_matmul():
  report = audited_step({})
  assert report.fp32_could_be_half == []
  assert report.half_flop_share == 1.0


def test_audit_counts_scan_trip_counts():
  def f(w, x):
    return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]
  report = dg.audit_step(f, jnp.ones((8, 8), jnp.bfloat16), jnp.ones((4, 8), jnp.bfloat16))
  (record,) = report.matmuls
  assert record.times == 5 and record.flops == 5 * 2 * 4 * 8 * 8


# --- memory report ---------------------------------------------------------


class Wide(nn.Module):
  """Few weights, large batch: activations dominate."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = jnp.tanh(nn.Dense(32)(x))
    return nn.Dense(4)(x)


def memory_row_for(spec, name=None, fused=False, compile_step=True, **optimizer):
  policy = jmp_lab.get_policy(spec)
  model = jl.with_policy(Wide(), policy)
  x = jnp.ones((4096, 32))
  params = policy.cast_to_param(model.init(jax.random.key(0), x[:1])["params"])
  if fused:
    tx = jmp_lab.fused_adamw(1e-3, policy=policy,
                             loss_scale=jmp_lab.DynamicLossScale(), **optimizer)
  else:
    mu_dtype = optimizer.pop("mu_dtype", None)
    tx = jmp_lab.mixed_precision(optax.adam(1e-3, mu_dtype=mu_dtype),
                                 policy=policy,
                                 loss_scale=jmp_lab.DynamicLossScale(), **optimizer)
  opt_state = tx.init(params)

  def loss(params, x):
    return jnp.mean(model.apply({"params": params}, x).astype(jnp.float32) ** 2)

  def step(params, opt_state, x):
    grads = jax.grad(loss)(params, x)
    return tx.update(grads, opt_state, params)

  return dg.memory_row(name or spec, params=params, opt_state=opt_state, loss_fn=loss,
                       loss_args=(params, x), step=step if compile_step else None,
                       step_args=(params, opt_state, x))


def test_memory_report_master_weights_cost_params_save_activations():
  fp32 = memory_row_for("float32")
  mixed = memory_row_for("p=bf16,c=bf16,o=f32")  # bf16 params + fp32 master
  assert mixed.param_bytes > fp32.param_bytes          # 2 B + 4 B vs 4 B
  assert mixed.param_bytes == pytest.approx(1.5 * fp32.param_bytes)
  assert mixed.activation_bytes < 0.6 * fp32.activation_bytes
  assert fp32.activation_bytes > 10 * fp32.param_bytes  # activations dominate
  assert fp32.compiled["peak"] > 0 and mixed.compiled["peak"] > 0
  table = dg.memory_report([fp32, mixed]).table()
  assert "float32" in table and "p=bf16" in table and "B/param" in table


@pytest.mark.parametrize("optimizer,state_bytes", [
    (dict(), 14),                                                   # fp32 master
    (dict(master="remainder"), 12),
    (dict(master="remainder", mu_dtype=jnp.bfloat16), 10),          # optax: mu only
    (dict(master="none", rounding="stochastic"), 10),
    (dict(master="none", rounding="stochastic", mu_dtype=jnp.bfloat16), 8),
    (dict(fused=True), 14),
    (dict(fused=True, master="remainder", mu_dtype=jnp.bfloat16,
          nu_dtype=jnp.bfloat16), 8),
    (dict(fused=True, master="none", rounding="stochastic"), 10),
    (dict(fused=True, master="none", rounding="stochastic",
          mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16), 6),
])
def test_memory_report_bytes_per_param_of_each_master_mode(optimizer, state_bytes):
  row = memory_row_for("p=bf16,c=bf16,o=f32", compile_step=False, **dict(optimizer))
  # A few scalars (loss scale, counters, the key) on 3,300 params.
  assert row.state_bytes_per_param == pytest.approx(state_bytes, abs=0.05)
  assert row.with_grads_bytes_per_param == pytest.approx(state_bytes + 2, abs=0.05)
  assert "B/param (+ grads)" in dg.memory_report([row]).table()


BF16 = "p=bf16,c=bf16,o=f32"


def nbytes(tree):
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def table_cells(report, row_index):
  """The cells of one row of a memory table (0: the first configuration)."""
  line = report.table().splitlines()[2 + row_index]
  return [cell.strip() for cell in line.strip("|").split("|")]


def test_memory_row_of_linen_params_needs_no_loss():
  params = {"w": jnp.zeros((64, 32), jnp.bfloat16),
            "b": jnp.zeros((32,), jnp.bfloat16)}
  opt_state = jmp_lab.mixed_precision(optax.adamw(1e-3),
                                      policy=BF16).init(params)
  row = dg.memory_row("adamw", params=params, opt_state=opt_state)
  n = 64 * 32 + 32
  master = 4 * n  # the fp32 master counts with the params, not the optimizer
  assert row.params == n
  assert row.param_bytes == 2 * n + master
  assert row.optimizer_bytes == nbytes(opt_state) - master
  assert row.grad_bytes == 2 * n
  assert row.activation_bytes is None
  assert row.compiled == {} and row.device_peak is None


def test_memory_row_measures_a_model_from_its_shapes_alone():
  """jax.eval_shape's params and state: a model too large to build."""
  params = {"w": jnp.zeros((64, 32), jnp.bfloat16),
            "b": jnp.zeros((32,), jnp.bfloat16)}
  tx = jmp_lab.fused_adamw(1e-3, policy=BF16, master="remainder")
  built = dg.memory_row("built", params=params, opt_state=tx.init(params))
  shapes = jax.eval_shape(lambda: params)
  abstract = dg.memory_row("shapes", params=shapes,
                           opt_state=jax.eval_shape(tx.init, shapes))
  assert dataclasses.replace(abstract, name="built") == built
  assert abstract.params == 64 * 32 + 32


class BatchNormed(nnx.Module):
  """Params and batch statistics: only the params are counted."""

  def __init__(self, rngs):
    self.dense = nnx.Linear(16, 32, rngs=rngs)
    self.norm = nnx.BatchNorm(32, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.dense(x))


@pytest.mark.parametrize("optimizer", ["flax", "jmp_lab"])
def test_memory_row_reads_an_nnx_model_and_optimizer_as_they_are(optimizer):
  if optimizer == "flax":
    model = BatchNormed(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  else:
    model = jmp_lab.nnx.with_policy(BatchNormed(nnx.Rngs(0)), BF16)
    opt = jmp_lab.nnx.Optimizer(model, jmp_lab.mixed_precision(
        optax.adamw(1e-3), policy=BF16), wrt=nnx.Param)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  master = 4 * n if optimizer == "jmp_lab" else 0
  row = dg.memory_row(optimizer, params=model, opt_state=opt)
  assert row.params == n == 16 * 32 + 32 + 2 * 32  # no batch statistics
  assert row.param_bytes == nbytes(params) + master
  # The optax state and the step counter, the master moved to the params.
  assert row.optimizer_bytes == nbytes(
      nnx.as_pure(nnx.state(opt, nnx.OptState))) - master
  assert row.activation_bytes is None


def test_memory_table_columns_without_a_figure_print_n_a():
  uncompiled = memory_row_for("float32", compile_step=False)  # a loss, no step
  compiled = memory_row_for("float32")
  report = dg.memory_report([uncompiled, compiled])
  activations, args, temp, peak = 5, 6, 7, 8
  assert table_cells(report, 0)[args:peak + 1] == ["n/a"] * 3
  assert float(table_cells(report, 0)[activations]) > 0
  assert all(float(cell) > 0 for cell in table_cells(report, 1)[args:peak + 1])
  no_loss = dg.memory_row("no loss", params={"w": jnp.zeros((8, 8))},
                          opt_state=())
  assert table_cells(dg.memory_report([no_loss]), 0)[activations:] == [
      "n/a"] * 5


# A GPT-2 block's shapes (768 wide), as the README's table measures them.
GPT2_BLOCK = {"attn": (768, 2304), "proj": (768, 768), "fc": (768, 3072),
              "out": (3072, 768), "ln": (768,), "bias": (3072,)}


def eight_bit_bytes_per_param(shapes, master_bytes):
  """bf16 params (2 B) and ``master_bytes`` an element of master, and two
  8-bit moments: a byte an element and an fp32 scale a block of 256 along
  the last axis, or fp32 moments for a leaf under 4,096 elements."""
  total = 0
  for shape in shapes.values():
    size = math.prod(shape)
    if size >= 4096 and shape[-1] % 256 == 0:
      moments = 2 * (size + 4 * size // 256)
    else:
      moments = 2 * 4 * size
    total += size * (2 + master_bytes) + moments
  return total / sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize("master,rounding,remainder_bytes,readme", [
    ("remainder", "nearest", 2, "6.03"),   # a 16-bit remainder
    ("none", "stochastic", 0, "4.03"),
])
def test_memory_row_of_8_bit_moments_prints_the_readmes_bytes_per_param(
    master, rounding, remainder_bytes, readme):
  params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in GPT2_BLOCK.items()}
  tx = jmp_lab.fused_adamw(1e-3, policy=BF16, master=master, rounding=rounding,
                           mu_dtype="int8", nu_dtype="int8")
  row = dg.memory_row("8-bit", params=params, opt_state=tx.init(params))
  expected = eight_bit_bytes_per_param(GPT2_BLOCK, remainder_bytes)
  # The state's scalars (count, loss scale, key) are bytes on 7M params.
  assert row.state_bytes_per_param == pytest.approx(expected, abs=1e-4)
  assert f"{expected:.2f}" == readme
  state_column = 3
  assert table_cells(dg.memory_report([row]), 0)[state_column] == readme


def make_bad_memory_row_call(case):
  params = {"w": jnp.zeros((4, 4), jnp.bfloat16)}
  tx = jmp_lab.mixed_precision(optax.adamw(1e-3), policy=BF16)
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  kwargs = dict(name="row", params=params, opt_state=tx.init(params))
  kwargs.update({
      "name is a number": dict(name=3),
      "the optimizer as params": dict(params=nnx.Optimizer(
          model, optax.adamw(1e-3), wrt=nnx.Param)),
      "a linen module as params": dict(params=nn.Dense(3)),
      "params without a float": dict(params={"step": jnp.int32(0)}),
      "the transformation as opt_state": dict(opt_state=tx),
      "the model as opt_state": dict(opt_state=model),
      "an nnx.State as opt_state": dict(opt_state=nnx.state(
          nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))),
      "loss_fn is no function": dict(loss_fn="loss"),
      "loss_args is one array": dict(loss_fn=jnp.sum, loss_args=jnp.ones(3)),
      "step is no function": dict(step=1, step_args=()),
  }[case])
  name = kwargs.pop("name")
  return lambda: dg.memory_row(name, **kwargs)


@pytest.mark.parametrize("case,error,words", [
    ("name is a number", TypeError, ["name", "int 3", "a str"]),
    ("the optimizer as params", TypeError,
     ["params", "Optimizer", "pytree of arrays", "as opt_state="]),
    ("a linen module as params", TypeError,
     ["params", "Dense", "flax.nnx.Module", "model.init(rng, x)['params']"]),
    ("params without a float", ValueError,
     ["params", "no floating array", "{'step'", "pytree of arrays"]),
    ("the transformation as opt_state", TypeError,
     ["opt_state", "GradientTransformationExtraArgs", "an optax state",
      "tx.init(params)"]),
    ("the model as opt_state", TypeError,
     ["opt_state", "Linear", "an optax state", "as params="]),
    ("an nnx.State as opt_state", TypeError,
     ["opt_state", "State", "nnx.Optimizer itself"]),
    ("loss_fn is no function", TypeError, ["loss_fn", "str 'loss'",
                                           "a function"]),
    ("loss_args is one array", TypeError, ["loss_args", "Array",
                                           "tuple or list", "loss_args=(x,)"]),
    ("step is no function", TypeError, ["step", "int 1", "a function"]),
])
def test_memory_row_names_the_bad_argument_its_value_and_what_it_takes(
    case, error, words):
  call = make_bad_memory_row_call(case)
  with pytest.raises(error) as raised:
    call()
  message = str(raised.value)
  assert message.startswith("memory_row's "), message
  missing = [w for w in words if w not in message]
  assert not missing, (missing, message)


# --- recorder --------------------------------------------------------------


def test_recorder_never_syncs_while_recording(tmp_path):
  recorder = dg.TrainingRecorder()
  step = jax.jit(lambda i: {"loss": 1.0 / (i + 1.0), "loss_scale": 2.0**i,
                            "skipped_steps": i // 2, "grads_finite": i % 2 == 0})
  with jax.transfer_guard_device_to_host("disallow"):
    for i in range(6):
      recorder.record(step(jnp.float32(i)))
  history = recorder.history()
  chex.assert_trees_all_close(history["loss_scale"], 2.0 ** np.arange(6))
  assert history["skipped_steps"].tolist() == [0, 0, 1, 1, 2, 2]
  recorder.plot(str(tmp_path / "trace.png"))
  assert (tmp_path / "trace.png").stat().st_size > 5000


def test_every_report_prints_its_table():
  hist = dg.gradient_histogram({"w": jnp.array([2.0**-30, 1.0, 0.0])})
  assert str(hist) == hist.table() and "underflow %" in hist.table()
  audit = dg.audit_step(lambda a, b: a @ b, jnp.ones((8, 8)), jnp.ones((8, 8)))
  assert str(audit) == audit.table() and "FLOP %" in audit.table()
  assert str(dg.memory_report([])).startswith("| config |")


class RematScanned(nn.Module):
  """Two Dense layers under nn.remat, scanned three times with nn.scan."""

  @nn.compact
  def __call__(self, x, _):
    block = nn.remat(lambda mdl, h: nn.Dense(8)(nn.Dense(8)(h)))
    return block(self, x), None


@pytest.mark.parametrize("where", ["jax.checkpoint", "nn.remat+nn.scan",
                                   "shard_map"])
def test_audit_counts_the_matmuls_inside_checkpoint_scan_and_shard_map(where):
  """jax 0.10's checkpoint and shard_map hold open jaxprs (no .jaxpr)."""
  x = jnp.ones((4, 8), jnp.bfloat16)
  if where == "jax.checkpoint":
    w = jnp.ones((8, 8), jnp.bfloat16)
    fn, args, expected = jax.checkpoint(lambda w, x: (x @ w) @ w), (w, x), 2
  elif where == "nn.remat+nn.scan":
    model = nn.scan(RematScanned, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=3)()
    x = x.astype(jnp.float32)  # the carry keeps the params' dtype
    params = model.init(jax.random.key(0), x, None)
    fn, args, expected = (lambda p, x: model.apply(p, x, None)[0]), (
        params, x), 2
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    w = jnp.ones((8, 8), jnp.bfloat16)
    fn = jax.shard_map(lambda w, x: x @ w, mesh=mesh,
                       in_specs=(P(), P("d")), out_specs=P("d"))
    args, expected = (w, x), 1
  report = audit_step(fn, *args)
  assert len(report.matmuls) == expected
  if where == "nn.remat+nn.scan":
    assert {r.times for r in report.matmuls} == {3}


def test_the_audit_table_shows_what_a_half_gemm_accumulates_in():
  """An fp16 product's row: its result fp16 under ``out`` and fp32 under
  ``acc``, what cuBLAS accumulates in (the table showed the result dtype
  under ``acc``, which read as fp16 accumulation)."""
  report = jmp_lab.diagnostics.audit_step(
      lambda a, b: a @ b, jnp.ones((16, 16), jnp.float16),
      jnp.ones((16, 16), jnp.float16))
  header, row = report.table().splitlines()[:2]
  assert header.split()[:4] == ["op", "operands", "out", "acc"]
  assert row.split()[:4] == ["dot_general", "float16/float16", "float16",
                             "float32"]
