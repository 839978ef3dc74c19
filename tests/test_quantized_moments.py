"""8-bit Adam moments: the maps, both optimizers, every master, skipped
steps, bytes a parameter, orbax, layouts and frameworks."""

import pathlib
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jmp_lab
from jmp_lab.kernels import quantized
from jmp_lab.optimizer import quantized_adamw, scale_by_quantized_adam

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

BF16 = "p=bf16,c=bf16,o=f32"
KINDS = ["int8", "float8_e4m3fn"]


def bits_equal(a, b) -> bool:
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(
      np.asarray(x).dtype == np.asarray(y).dtype
      and np.asarray(x).tobytes() == np.asarray(y).tobytes()
      for x, y in zip(la, lb))


def model_params(seed=0, dtype=jnp.bfloat16):
  """Quantizable leaves (block 256 and block 32), and small ones that keep
  fp32 moments."""
  rng = np.random.default_rng(seed)
  shapes = {"w": (64, 512), "e": (64, 96), "b": (512,), "scale": (96,)}
  return {k: jnp.asarray(rng.normal(size=v) * 0.05, dtype)
          for k, v in shapes.items()}


def grads_for(params, step, poison=False):
  def leaf(x):
    g = jnp.sin(x.astype(jnp.float32) * 40.0 + step) * 10.0 ** (
        -(jnp.arange(x.size).reshape(x.shape) % 5))  # magnitudes over 1e-4
    return (g.at[(0,) * x.ndim].set(jnp.inf) if poison else g).astype(x.dtype)
  return jax.tree_util.tree_map(leaf, params)


def run(tx, params, steps, poison_at=()):
  state = tx.init(params)

  @jax.jit
  def step(params, state, i, poison):
    grads = jax.lax.cond(poison, lambda: grads_for(params, i, True),
                         lambda: grads_for(params, i))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(steps):
    params, state = step(params, state, i, i in poison_at)
  return params, state


# --- the maps ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_positive_second_moment_never_dequantizes_to_zero(kind):
  """``rsqrt(nu)`` would blow the update up: 36 decades in one block (the
  whole range of normal fp32 values; XLA flushes subnormals to zero)."""
  nu = jnp.asarray(10.0 ** -np.linspace(0, 36, 256), jnp.float32)[None]
  codes, scales = quantized.quantize(nu, kind, second=True)
  back = quantized.dequantize(codes, scales, kind, second=True)
  assert bool(jnp.all(back > 0))
  # values under the smallest code are overstated to it, never lost
  smallest = float(back.min())
  assert bool(jnp.all(jnp.where(nu < smallest, back == smallest, True)))
  # and a zero stays zero (a param with no gradient yet)
  codes, scales = quantized.quantize(jnp.zeros((1, 256)), kind, second=True)
  assert not bool(jnp.any(quantized.dequantize(codes, scales, kind, True)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("second", [False, True])
def test_the_maps_keep_values_near_the_block_maximum_within_a_few_percent(
    kind, second):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 256)).astype(np.float32)
  x = x * x if second else x
  codes, scales = quantized.quantize(jnp.asarray(x), kind, second)
  back = np.asarray(quantized.dequantize(codes, scales, kind, second))
  big = np.abs(x) > 0.1 * np.abs(x).max(axis=1, keepdims=True)
  rel = np.abs(back - x)[big] / np.abs(x)[big]
  # int8's square law: 1/127 of the root's range; fp8: 3 mantissa bits
  assert np.median(rel) < 0.05 and rel.max() < 0.2
  assert np.all(np.sign(back[big]) == np.sign(x[big]))


def test_leaves_too_small_or_without_a_block_keep_fp32_moments():
  assert quantized.block_size((64, 512)) == 256
  assert quantized.block_size((64, 96)) == 32
  assert quantized.block_size((1000, 50257)) is None
  assert not quantized.quantizable((96,))          # under 4,096 elements
  assert not quantized.quantizable((1000, 50257))  # no block divides it
  state = jmp_lab.fused_adamw(1e-3, policy=BF16, mu_dtype="int8",
                              nu_dtype="int8").init(model_params())
  assert isinstance(state.mu["w"], jmp_lab.state.QuantizedMoment)
  assert state.mu["w"].scales.shape == (64, 2)
  assert state.nu["e"].scales.shape == (64, 3)
  assert state.mu["scale"].dtype == jnp.float32


# --- bytes a parameter -------------------------------------------------------


def bytes_per_param(tx, params) -> float:
  """Params plus the optimizer state's arrays, per parameter."""
  state = tx.init(params)
  total = sum(x.nbytes for x in jax.tree_util.tree_leaves((params, state)))
  return total / sum(x.size for x in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("master,bound", [("none", 4.1), ("remainder", 6.1)])
def test_adamw_with_8_bit_moments_stores_4_or_6_bytes_a_parameter(master,
                                                                  bound):
  """A GPT-2-block-shaped model (768-wide), bf16 params."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.bfloat16) for k, s in {
      "attn": (768, 2304), "proj": (768, 768), "fc": (768, 3072),
      "out": (3072, 768), "ln": (768,), "bias": (3072,)}.items()}
  rounding = "stochastic" if master == "none" else "nearest"
  for kind in KINDS:
    tx = jmp_lab.fused_adamw(1e-3, policy=BF16, master=master,
                             rounding=rounding, mu_dtype=kind, nu_dtype=kind)
    measured = bytes_per_param(tx, params)
    assert bound - 0.1 < measured <= bound, (kind, measured)
  bf16 = jmp_lab.fused_adamw(1e-3, policy=BF16, master=master,
                             rounding=rounding, mu_dtype=jnp.bfloat16,
                             nu_dtype=jnp.bfloat16)
  assert bytes_per_param(bf16, params) == pytest.approx(bound - 0.1 + 2,
                                                        abs=0.01)


# --- fused_adamw: every backend and master -----------------------------------


# Each master with int8, and fp8 with one (interpret mode is slow on CPUs).
KERNEL_CASES = [
    ("int8", dict(master="float32")),
    ("int8", dict(master="remainder")),
    ("int8", dict(master="none", rounding="stochastic")),
    ("float8_e4m3fn", dict(master="remainder")),
]


@pytest.mark.parametrize("kind,lean", KERNEL_CASES,
                         ids=lambda x: x if isinstance(x, str) else x["master"])
def test_the_pallas_kernel_quantizes_in_registers_as_the_reference(kind,
                                                                    lean):
  """The multi-tensor kernel (interpret mode) and XLA's reference agree, but
  for a code here and there: where two fusions round an fp32 value a ulp
  apart (an FMA contracted in one and not the other) across a quantization
  boundary, the codes differ by one."""
  params = model_params()
  outs = {}
  for backend in ("reference", "interpret"):
    tx = jmp_lab.fused_adamw(1e-2, policy=BF16, backend=backend,
                             mu_dtype=kind, nu_dtype=kind, **lean)
    outs[backend] = run(tx, params, 4)
  assert_backends_agree(outs["reference"], outs["interpret"])


def assert_backends_agree(a, b):
  """Params within a bf16 step or two; under 0.1% of codes apart."""
  (p_a, s_a), (p_b, s_b) = a, b
  f32 = lambda t: jax.tree_util.tree_map(  # noqa: E731
      lambda x: jnp.asarray(x, jnp.float32), t)
  chex.assert_trees_all_close(f32(p_a), f32(p_b), atol=2e-3)
  for m_a, m_b in zip(jax.tree_util.tree_leaves((s_a.mu, s_a.nu)),
                      jax.tree_util.tree_leaves((s_b.mu, s_b.nu))):
    assert m_a.dtype == m_b.dtype
    if m_a.dtype.itemsize == 1:  # codes
      apart = np.asarray(m_a, np.float32) != np.asarray(m_b, np.float32)
      assert np.mean(apart) < 1e-3


@pytest.mark.parametrize("backend,kind", [("reference", "int8"),
                                          ("reference", "float8_e4m3fn"),
                                          ("interpret", "int8")])
def test_a_skipped_step_leaves_the_quantized_state_bit_identical(backend,
                                                                  kind):
  tx = jmp_lab.fused_adamw(1e-2, policy=BF16, backend=backend,
                           master="remainder", mu_dtype=kind, nu_dtype=kind,
                           loss_scale=jmp_lab.DynamicLossScale())
  params, state = run(tx, model_params(), 3)
  grads = grads_for(params, 3, poison=True)
  scaled = jmp_lab.ScaledGradients(grads)
  _, after = jax.jit(tx.update)(scaled, state, params)
  assert not bool(after.last_step_applied)
  assert bits_equal((after.mu, after.nu, after.master_remainder),
                    (state.mu, state.nu, state.master_remainder))


@pytest.mark.parametrize("kind", KINDS)
def test_the_flat_layout_quantizes_a_row_a_block_as_the_reference(kind):
  """``layout="flat"``: a row of 256 lanes is a block. The Pallas kernel
  (interpret mode) and the reference agree (as above), a skipped step
  counts, and the buffers are 1 B + a scale a row."""
  params = model_params()
  outs = {}
  for backend in ("reference", "interpret"):
    tx = jmp_lab.fused_adamw(1e-2, policy=BF16, backend=backend,
                             layout="flat", mu_dtype=kind, nu_dtype=kind)
    outs[backend] = run(tx, params, 3, poison_at=(1,))
  assert_backends_agree(outs["reference"], outs["interpret"])
  state = outs["reference"][1]
  assert int(state.skipped_steps) == 1
  rows = state.mu.codes.shape[0]
  assert state.mu.codes.shape == (rows, 256) and state.mu.scales.shape == (
      rows, 1)


def test_8_bit_moments_are_refused_where_no_kernel_has_them():
  with pytest.raises(ValueError, match="nu_dtype=int8 need layout='tree'"):
    jmp_lab.fused_adamw(1e-3, policy=BF16, layout="flat", master="remainder",
                        nu_dtype="int8")
  with pytest.raises(ValueError, match=r"mu_dtype must be .*'int8'.*int4"):
    jmp_lab.fused_adamw(1e-3, policy=BF16, mu_dtype="int4")
  with pytest.raises(ValueError, match=r"nu_dtype must be 'int8'.*float16"):
    scale_by_quantized_adam(nu_dtype=jnp.float16)


# --- the optax transformation ------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_adamw_tracks_optax_adamw(kind):
  params = model_params(dtype=jnp.float32)
  want, _ = run(optax.adamw(1e-2, weight_decay=0.1), params, 30)
  got, state = run(quantized_adamw(1e-2, weight_decay=0.1, mu_dtype=kind,
                                   nu_dtype=kind), params, 30)
  moved = jax.tree_util.tree_map(lambda a, b: jnp.abs(a - b), want, params)
  diff = jax.tree_util.tree_map(lambda a, b: jnp.abs(a - b), want, got)
  for name in params:  # off by a few percent of how far Adam moved them
    assert float(jnp.mean(diff[name])) < 0.1 * float(jnp.mean(moved[name]))
  assert isinstance(state[0].mu["w"], jmp_lab.state.QuantizedMoment)


def test_mixed_precision_skips_with_the_codes_untouched():
  tx = jmp_lab.mixed_precision(quantized_adamw(1e-2), policy=BF16,
                               loss_scale=jmp_lab.DynamicLossScale())
  params, state = run(tx, model_params(), 3)
  scaled = jmp_lab.ScaledGradients(grads_for(params, 3, poison=True))
  updates, after = jax.jit(tx.update)(scaled, state, params)
  assert int(after.skipped_steps) == 1
  assert bits_equal(after.inner_state, state.inner_state)
  assert not any(bool(jnp.any(u)) for u in jax.tree_util.tree_leaves(updates))


# --- orbax, linen, NNX -------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["fused_adamw", "mixed_precision"])
def test_8_bit_states_survive_an_orbax_round_trip_bit_for_bit(optimizer,
                                                              tmp_path):
  if optimizer == "fused_adamw":
    tx = jmp_lab.fused_adamw(1e-2, policy=BF16, master="none",
                             rounding="stochastic", mu_dtype="int8",
                             nu_dtype="float8_e4m3fn")
  else:
    tx = jmp_lab.mixed_precision(quantized_adamw(1e-2), policy=BF16,
                                 master="remainder")
  params, state = run(tx, model_params(), 4)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", (params, state))
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt",
                                    target=jax.eval_shape(lambda: (params,
                                                                   state)))
  assert bits_equal(restored, (params, state))
  # and training goes on from the restored state exactly as from the live one
  assert bits_equal(run_from(tx, *restored), run_from(tx, params, state))


def run_from(tx, params, state):
  grads = grads_for(params, 7)
  updates, state = jax.jit(tx.update)(grads, state, params)
  return optax.apply_updates(params, updates), state


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(8)(x)


def test_a_linen_model_trains_with_8_bit_moments_through_make_train_step():
  model = jmp_lab.linen.with_policy(MLP(), BF16)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
  y = jnp.sin(x[:, :8])
  params = model.init(jax.random.key(0), x)["params"]
  state = jmp_lab.TrainState.create(
      apply_fn=model.apply, params=params, policy=BF16,
      tx=jmp_lab.fused_adamw(3e-3, policy=BF16, master="remainder",
                             mu_dtype="int8", nu_dtype="int8"))

  def loss_fn(params, state, batch):
    out = state.apply_fn({"params": params}, batch[0])
    return jnp.mean((out - batch[1]) ** 2)

  step = jmp_lab.make_train_step(loss_fn)
  first = None
  for _ in range(60):
    state, metrics = step(state, (x, y))
    first = float(metrics["loss"]) if first is None else first
  assert float(metrics["loss"]) < 0.5 * first
  assert isinstance(state.opt_state.mu["Dense_0"]["kernel"],
                    jmp_lab.state.QuantizedMoment)


def test_an_nnx_model_trains_with_8_bit_moments_in_flax_nnx_optimizer():
  model = jmp_lab.nnx.with_policy(
      nnx.Sequential(nnx.Linear(32, 256, rngs=nnx.Rngs(0)), nnx.relu,
                     nnx.Linear(256, 8, rngs=nnx.Rngs(1))), "mixed_bfloat16")
  optimizer = nnx.Optimizer(model, jmp_lab.mixed_precision(
      quantized_adamw(3e-3, mu_dtype="float8_e4m3fn"),
      policy="mixed_bfloat16"), wrt=nnx.Param)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
  y = jnp.sin(x[:, :8])

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(60)]
  assert losses[-1] < 0.5 * losses[0]


# --- compiled for the H100 ---------------------------------------------------


@pytest.mark.parametrize("moment", ["bfloat16", "int8", "float8_e4m3fn"])
def test_the_update_compiled_for_the_h100_moves_its_ideal_bytes_in_place(
    moment):
  """One GPT-2-small layer plus its embeddings: the update moves at most
  1.2x the ideal bytes (remainder master: 18 B/param with bf16 moments, 14
  with 8-bit), and no moment leaf is copied around the in-place kernel."""
  from benchmarks import quantized_update  # pylint: disable=import-outside-toplevel
  params = quantized_update.gpt2_params(1)
  report, copies = quantized_update.report(params, moment)
  assert copies == 0
  # (the statistics pass's read of the gradients counted against it too)
  assert report.bytes_accessed <= 1.2 * quantized_update.ideal_bytes(
      params, moment, with_stats=False)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_flat_kernel_with_8_bit_moments_compiles_for_the_h100(kind, backend):
  """The flat layout's kernels (Triton, Mosaic GPU), compiled for sm_90a
  inside the optimizer's update: one kernel, no moment copied, no register
  spills (``compiled_report`` fails on one). ``backend="mosaic"`` refused
  8-bit moments before its kernel had them."""
  from jmp_lab.diagnostics import compiled_report  # pylint: disable=import-outside-toplevel
  params = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_params())
  tx = jmp_lab.fused_adamw(1e-3, policy=BF16, layout="flat",
                           backend=backend, mu_dtype=kind, nu_dtype=kind)
  state = jax.eval_shape(tx.init, params)
  report = compiled_report(lambda g, p, s: tx.update.new_params(g, s, p),
                           params, params, state, donate_argnums=(1, 2))
  assert [k.backend for k in report.pallas_kernels] == [backend]
  code_copies = [line for line in report.hlo_text.splitlines()
                 if " copy(" in line and ("s8[" in line or "u8[" in line
                                          or "f8e4m3fn[" in line)]
  if backend == "triton":
    assert [k.name for k in report.pallas_kernels] == ["jmp_lab_fused_adamw"]
    assert not code_copies
  else:
    # plgpu.kernel cannot alias outputs to inputs: each fresh output is
    # copied into its donated buffer (the optimizers guide says so), once:
    # the master, both moments' codes and both scales, and nothing else.
    copies = [line for line in report.hlo_text.splitlines() if " copy(" in line]
    assert len(code_copies) == 2 and len(copies) == 5, copies


def test_jmp_lab_nnx_optimizer_trains_fused_8_bit_moments_laid_out_as_params():
  """``jmp_lab.nnx.Optimizer`` with ``fused_adamw`` 8-bit moments under
  NNX's eager sharding (``jax.set_mesh``): ``nnx_optimizer_shardings`` lays
  each codes and scales array out as its param, and it trains (``"auto"``
  runs the reference for arrays sharded in their type: tracing the kernel
  there failed, with fp32 moments too)."""
  mesh = jax.make_mesh((2,), ("fsdp",))
  with jax.set_mesh(mesh):
    model = jmp_lab.nnx.with_policy(nnx.Sequential(
        nnx.Linear(32, 256, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("fsdp", None))),
        nnx.relu, nnx.Linear(256, 8, rngs=nnx.Rngs(1))), BF16)
    optimizer = jmp_lab.nnx.Optimizer(model, jmp_lab.fused_adamw(
        3e-3, policy=BF16, master="remainder", mu_dtype="int8",
        nu_dtype="float8_e4m3fn"), wrt=nnx.Param)
  shardings = jmp_lab.sharding.nnx_optimizer_shardings(model, optimizer, mesh)
  mu = shardings["opt_state"]["mu"]["layers"][0]["kernel"]
  assert mu.codes.spec[0] == "fsdp" and mu.scales.spec == mu.codes.spec
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
  y = jnp.sin(x[:, :8])
  step = jmp_lab.nnx.make_train_step(
      lambda m, batch: jnp.mean((m(batch[0]) - batch[1]) ** 2))
  with jax.set_mesh(mesh):
    losses = [float(step(model, optimizer, (x, y))["loss"]) for _ in range(60)]
  assert losses[-1] < 0.5 * losses[0]


def test_a_last_axis_split_that_cuts_blocks_is_refused_or_gathered():
  """Tensor parallelism over a param's last axis into shards that are not
  whole blocks (160 wide, blocks of 32: 80 a device): ``state_shardings``
  refuses it by name, with the counts of shards that fit; the update jitted
  on such a layout warns, gathers that axis, and gives the one-device
  update. A split into whole blocks passes. (Before: the layout took the
  param's spec, and each device would have quantized half-blocks against
  scales it does not hold.)"""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
  tx = jmp_lab.fused_adamw(1e-3, policy="p=bf16,c=bf16,o=f32",
                           master="remainder", mu_dtype="int8",
                           nu_dtype="int8", backend="interpret",
                           loss_scale=jmp_lab.NoOpLossScale())
  rng = np.random.default_rng(0)
  params = {"cut": jnp.asarray(rng.normal(size=(32, 160)), jnp.bfloat16),
            "whole": jnp.asarray(rng.normal(size=(16, 512)), jnp.bfloat16)}
  grads = jax.tree_util.tree_map(lambda p: p * 1e-3, params)
  specs = {k: P(None, "tensor") for k in params}
  state = jmp_lab.TrainState.create(apply_fn=lambda *a: None, params=params,
                                    tx=tx, policy="p=bf16,c=bf16,o=f32")
  with pytest.raises(ValueError, match=(
      r"param \['cut'\]: .*blocks of 32 along the last axis \(160 wide\)"
      r".*2 shards of 80.*whole blocks \(5\)")):
    jmp_lab.sharding.state_shardings(state, mesh, axis_name=None,
                                     params_shardings=specs)
  layout = jmp_lab.sharding.state_shardings(
      state.replace(params={"whole": params["whole"]},
                    opt_state=tx.init({"whole": params["whole"]})),
      mesh, axis_name=None, params_shardings={"whole": specs["whole"]})
  assert layout.opt_state.mu["whole"].codes.spec == P(None, "tensor")

  put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k]))  # noqa: E731
                      for k, v in tree.items()}
  opt_state = tx.init(params)
  expected = tx.update(grads, opt_state, params)
  with pytest.warns(UserWarning, match=r"blocks of 32.*2 shards of 80.*"
                    r"gathers that axis"):
    got = jax.jit(tx.update)(put(grads), opt_state, put(params))
  chex.assert_trees_all_equal(got, expected)
