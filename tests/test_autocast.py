"""Tests for jmp_lab.autocast: torch.autocast's per-op rules for any JAX
function (plain JAX here; Flax, NNX and Equinox in test_real_models.py)."""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jmp_lab
from jmp_lab import fp8
from jmp_lab import reduce as reduce_lib
from jmp_lab.diagnostics import audit_step
from jmp_lab.diagnostics.audit import compiled_sub_jaxprs

BF16, F16, F32 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16,
                                         jnp.float32))


def eqns_named(jaxpr, names):
  """Every equation whose primitive is in ``names``, sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      found.append(eqn)
    for inner in compiled_sub_jaxprs(eqn):
      found += eqns_named(inner, names)
  return found


def operand_dtypes(fn, *args, names=("dot_general", "conv_general_dilated")):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [tuple(np.dtype(v.aval.dtype) for v in e.invars[:2])
          for e in eqns_named(jaxpr, set(names))]


def mlp(params, x):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def mlp_by_hand(params, x):
  """mlp with the casts autocast puts in, placed by hand: the matmuls in
  bf16, the biases read in bf16 where they are added, relu in bf16, the
  output in the policy's fp32."""
  half = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
  h = jax.nn.relu(half(x) @ half(params["w1"]) + half(params["b1"]))
  return (h @ half(params["w2"]) + half(params["b2"])).astype(jnp.float32)


def mlp_params(key=0):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  return {"w1": jax.random.normal(k1, (16, 32)) * 0.3,
          "b1": jnp.full((32,), 0.1),
          "w2": jax.random.normal(k2, (32, 8)) * 0.3,
          "b2": jnp.zeros((8,))}, jax.random.normal(k3, (4, 16))


class PlainJaxTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matmuls_in_bf16_and_gradients_equal_the_hand_cast_reference(self):
    params, x = mlp_params()
    loss = lambda f: lambda p, x: jnp.mean(f(p, x) ** 2)  # noqa: E731
    fast = jmp_lab.autocast(mlp, "mixed_bfloat16")
    got = self.variant(jax.value_and_grad(loss(fast)))(params, x)
    want = self.variant(jax.value_and_grad(loss(mlp_by_hand)))(params, x)
    chex.assert_trees_all_equal(got, want)
    chex.assert_type(jax.tree_util.tree_leaves(got[1]), jnp.float32)  # as params
    assert audit_step(jax.grad(loss(fast)), params, x).half_flop_share == 1.0

  @chex.variants(with_jit=True, without_jit=True)
  def test_output_dtype_and_fp32_policy_leaves_fn_as_written(self):
    params, x = mlp_params()
    chex.assert_type(self.variant(jmp_lab.autocast(mlp, "mixed_float16"))(
        params, x), F32)
    chex.assert_type(self.variant(jmp_lab.autocast(
        mlp, "p=f32,c=bf16,o=bf16"))(params, x), BF16)
    chex.assert_trees_all_equal(
        self.variant(jmp_lab.autocast(mlp, "float32"))(params, x),
        self.variant(mlp)(params, x))

  def test_matmuls_whatever_dtype_their_operands_arrive_in(self):
    def f(w, x):
      up = jnp.einsum("bd,dk->bk", x.astype(jnp.float32), w)   # fp32 by hand
      return jnp.matmul(up.astype(jnp.float16), w.T.astype(jnp.float16))

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8), jnp.bfloat16)
    assert operand_dtypes(jmp_lab.autocast(f, "mixed_bfloat16"), w, x) == [
        (BF16, BF16)] * 2
    assert operand_dtypes(f, w, x) == [(F32, F32), (F16, F16)]

  def test_convolutions_in_the_compute_dtype(self):
    def conv(w, x):
      return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                          dimension_numbers=("NHWC", "HWIO",
                                                             "NHWC"))
    w, x = jnp.ones((3, 3, 2, 4)), jnp.ones((1, 5, 5, 2))
    fast = jmp_lab.autocast(lambda w, x: conv(w, x).sum(), "mixed_float16")
    assert operand_dtypes(jax.grad(fast), w, x) == [(F16, F16)] * 2

  def test_integer_and_fp8_matmuls_are_left_alone(self):
    def f(a, b, x, w):
      ints = jax.lax.dot(a, b, preferred_element_type=jnp.int32)
      eights = jax.lax.dot(x, w, preferred_element_type=jnp.float32)
      return ints, eights

    a = b = jnp.ones((16, 16), jnp.int8)
    x = w = jnp.ones((16, 16), jnp.float8_e4m3fn)
    dtypes = operand_dtypes(jmp_lab.autocast(f, "mixed_bfloat16"), a, b, x, w)
    assert dtypes == [(np.dtype(jnp.int8),) * 2,
                      (np.dtype(jnp.float8_e4m3fn),) * 2]


# ---------------------------------------------------------------------------
# fp32 ops.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    functools.partial(jax.nn.softmax, axis=-1),
    functools.partial(jax.nn.log_softmax, axis=-1),
    functools.partial(jax.nn.logsumexp, axis=-1),
], ids=["softmax", "log_softmax", "logsumexp"])
def test_softmax_family_of_half_inputs_is_the_fp32_result_bit_for_bit(fn):
  x = (jax.random.normal(jax.random.key(1), (6, 50)) * 30).astype(jnp.bfloat16)
  got = jax.jit(jmp_lab.autocast(fn, "mixed_bfloat16"))(x)
  chex.assert_trees_all_equal(got, jax.jit(fn)(x.astype(jnp.float32)))
  assert not np.array_equal(np.asarray(fn(x), np.float32), got)


def test_a_custom_attention_runs_its_softmax_in_fp32():
  def attention(q, k, v):
    logits = jnp.einsum("qd,kd->qk", q, k)
    mask = jnp.tril(jnp.ones(logits.shape, bool))
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    return weights.astype(v.dtype) @ v

  q, k, v = (jax.random.normal(key, (32, 16), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(0), 3))
  fast = jmp_lab.autocast(attention, "p=bf16,c=bf16,o=bf16")
  jaxpr = jax.make_jaxpr(fast)(q, k, v).jaxpr
  assert [np.dtype(e.invars[0].aval.dtype) for e in eqns_named(
      jaxpr, {"exp"})] == [F32]
  assert [np.dtype(e.invars[0].aval.dtype) for e in eqns_named(
      jaxpr, {"reduce_sum"})] == [F32]
  assert operand_dtypes(fast, q, k, v) == [(BF16, BF16)] * 2
  want = attention(*(a.astype(jnp.float32) for a in (q, k, v)))
  chex.assert_trees_all_close(fast(q, k, v).astype(jnp.float32), want,
                              atol=0.05, rtol=0.02)


def test_a_norm_written_inline_takes_its_statistics_in_fp32():
  def rms_norm(x, scale):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * scale

  x = jax.random.normal(jax.random.key(0), (4, 64), jnp.bfloat16) * 3
  scale = jnp.ones((64,), jnp.bfloat16)
  fast = jmp_lab.autocast(rms_norm, "p=bf16,c=bf16,o=f32")
  jaxpr = jax.make_jaxpr(fast)(x, scale).jaxpr
  for eqn in eqns_named(jaxpr, {"reduce_sum", "rsqrt", "integer_pow",
                                "square"}):
    assert np.dtype(eqn.invars[0].aval.dtype) == F32, eqn
  want = rms_norm(x.astype(jnp.float32), scale.astype(jnp.float32))
  chex.assert_trees_all_close(fast(x, scale), want, rtol=1e-6)


def test_gelu_follows_its_input_as_torch_does():
  x = jnp.ones((4, 8), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jmp_lab.autocast(jax.nn.gelu, "p=bf16,c=bf16"))(x)
  assert {np.dtype(e.invars[0].aval.dtype) for e in eqns_named(
      jaxpr.jaxpr, {"tanh", "mul"})} == {BF16}


def test_extra_and_replaced_fp32_ops():
  x = jnp.ones((4,), jnp.bfloat16)
  f = lambda x: jnp.tanh(x) + jnp.exp(x)  # noqa: E731

  def input_dtype(fn, name):
    (eqn,) = eqns_named(jax.make_jaxpr(fn)(x).jaxpr, {name})
    return np.dtype(eqn.invars[0].aval.dtype)

  spec = "p=bf16,c=bf16"
  assert input_dtype(jmp_lab.autocast(f, spec), "tanh") == BF16
  assert input_dtype(jmp_lab.autocast(f, spec, extra_fp32_ops=["tanh"]),
                     "tanh") == F32
  assert input_dtype(jmp_lab.autocast(f, spec, fp32_ops=["tanh"]),
                     "exp") == BF16


# ---------------------------------------------------------------------------
# Overrides.
# ---------------------------------------------------------------------------


def two_layers(w, x):
  with jax.named_scope("body"):
    x = x @ w
  with jax.named_scope("head"):
    return x @ w


def test_exclude_keeps_matching_named_scopes_as_written():
  w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
  fast = jmp_lab.autocast(two_layers, "mixed_bfloat16", exclude="^head$")
  assert operand_dtypes(fast, w, x) == [(BF16, BF16), (F32, F32)]


def test_scope_inside_the_function_wins_innermost_first():
  def f(w, x):
    with jmp_lab.autocast.scope(jnp.float32):
      x = x @ w
      with jmp_lab.autocast.scope(jnp.float16):
        x = x.astype(jnp.float32) @ w
    return x @ w

  w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
  assert operand_dtypes(jmp_lab.autocast(f, "mixed_bfloat16"), w, x) == [
      (F32, F32), (F16, F16), (BF16, BF16)]


# ---------------------------------------------------------------------------
# Composition with JAX's transformations.
# ---------------------------------------------------------------------------


@jax.custom_vjp
def clipped_matmul(x, w):
  return x @ w


def _clipped_fwd(x, w):
  return x @ w, (x, w)


def _clipped_bwd(residuals, g):
  x, w = residuals
  g = jnp.clip(g, -0.5, 0.5)  # a custom gradient autodiff would not give
  return g @ w.T, x.T @ g


clipped_matmul.defvjp(_clipped_fwd, _clipped_bwd)


@jax.custom_jvp
def soft_sign(x):
  return x / (1 + jnp.abs(x))


@soft_sign.defjvp
def _soft_sign_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return soft_sign(x), 7.0 * t  # a custom derivative


def stack(w, x):
  def layer(h, _):
    return jax.checkpoint(lambda h: jnp.tanh(h @ w))(h), None

  h, _ = jax.lax.scan(layer, x, None, length=3)
  h = clipped_matmul(h, w)
  h = jax.lax.cond(h.sum() > 0, lambda h: h @ w, lambda h: -h, h)
  h = jax.jit(lambda h: soft_sign(h @ w))(h)
  return jnp.sum(h ** 2)


def test_grad_vmap_scan_remat_cond_jit_and_custom_rules_compose():
  w = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
  x = jax.random.normal(jax.random.key(1), (4, 8))
  fast = jmp_lab.autocast(stack, "mixed_bfloat16")
  grad_dtypes = operand_dtypes(jax.grad(fast), w, x)
  assert len(grad_dtypes) >= 12 and set(grad_dtypes) == {(BF16, BF16)}
  got = jax.jit(jax.grad(fast))(w, x)
  want = jax.grad(stack)(w, x)
  chex.assert_trees_all_close(got, want, rtol=0.05, atol=0.05)
  batched = jax.vmap(fast, in_axes=(None, 0))(w, jnp.stack([x, -x]))
  chex.assert_shape(batched, (2,))
  assert set(operand_dtypes(jax.vmap(fast, in_axes=(None, 0)), w,
                            jnp.stack([x, x]))) == {(BF16, BF16)}


def test_custom_vjp_and_custom_jvp_rules_still_decide_the_gradient():
  w = jnp.eye(4) * 3.0
  x = jnp.ones((2, 4))
  clipped = jmp_lab.autocast(lambda w: clipped_matmul(x, w).sum(),
                             "mixed_bfloat16")
  chex.assert_trees_all_equal(jax.grad(clipped)(w), jnp.full((4, 4), 1.0))
  jvp = jmp_lab.autocast(lambda x: soft_sign(x).sum(), "mixed_bfloat16")
  chex.assert_trees_all_equal(jax.grad(jvp)(jnp.ones(3)), jnp.full(3, 7.0))


def test_custom_vjp_keeps_an_fp32_accumulation_it_asks_for():
  """jmp_lab.reduce's weight gradient: half operands, fp32 result."""
  dot = reduce_lib.dot_general(jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  f = jmp_lab.autocast(lambda w, x: dot(x, w, dims).sum(), "mixed_bfloat16")
  w, x = jnp.ones((8, 4)), jnp.ones((16, 8))
  gemms = eqns_named(jax.make_jaxpr(jax.grad(f))(w, x).jaxpr, {"dot_general"})
  kinds = {(tuple(np.dtype(v.aval.dtype) for v in e.invars),
            np.dtype(e.params["preferred_element_type"])) for e in gemms}
  assert ((BF16, BF16), F32) in kinds           # the weight gradient
  assert all(ops == (BF16, BF16) for ops, _ in kinds)
  chex.assert_trees_all_equal(jax.grad(f)(w, x), jnp.full((8, 4), 16.0))


def test_fp8_matmuls_compose_unchanged():
  x = jax.random.normal(jax.random.key(0), (16, 32), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (32, 16), jnp.bfloat16)
  f = lambda x, w: fp8.dot_general(x, w, (((1,), (0,)), ((), ())))  # noqa
  fast = jmp_lab.autocast(f, "p=bf16,c=bf16,o=bf16")
  chex.assert_trees_all_equal(jax.jit(fast)(x, w), jax.jit(f)(x, w))
  assert audit_step(fast, x, w).fp8_flop_share == 1.0


def test_shard_map_bodies_are_reached():
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

  def data_parallel(w, x):
    def per_shard(w, x):
      return jax.lax.psum(jnp.sum((x @ w) ** 2), "data")
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data")),
                         out_specs=P())(w, x)

  w = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (4, 8))
  fast = jmp_lab.autocast(data_parallel, "mixed_bfloat16")
  assert set(operand_dtypes(jax.grad(fast), w, x)) == {(BF16, BF16)}
  want = jax.grad(data_parallel)(w, x)
  chex.assert_trees_all_close(jax.jit(jax.grad(fast))(w, x), want,
                              atol=0.02 * float(jnp.abs(want).max()))


def test_a_function_that_differentiates_inside_is_reached_too():
  """autocast of a whole step: the backward GEMMs are already in the jaxpr,
  and a checkpoint's body is marked as differentiated."""
  def step(w, x):
    loss = lambda w: jnp.sum(jax.checkpoint(lambda x: jnp.tanh(x @ w))(x))
    return jax.grad(loss)(w)

  w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))
  assert set(operand_dtypes(jmp_lab.autocast(step, "mixed_bfloat16"), w,
                            x)) == {(BF16, BF16)}


def test_non_array_arguments_and_outputs_pass_through():
  def f(x, scale, activation, config):
    return {"y": activation(x) * scale, "name": config["name"], "none": None}

  out = jmp_lab.autocast(f, "mixed_bfloat16")(
      jnp.ones(3), 2.0, jax.nn.relu, {"name": "m"})
  assert out["name"] == "m" and out["none"] is None
  chex.assert_trees_all_equal(out["y"], jnp.full(3, 2.0))


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"fn": 3}, TypeError, "callable fn, got int"),
    ({"policy": "mixed_bf16"}, ValueError, "mixed_bf16"),
    ({"extra_fp32_ops": ["softmax"]}, ValueError, "unknown primitive names "
                                                  r"\['softmax'\]"),
    ({"exclude": "head("}, ValueError, "invalid exclude pattern 'head\\('"),
    ({"exclude": [3]}, TypeError, "exclude must hold regular expressions"),
    # fp8 needs a layer's weights and state: silently bf16 before.
    ({"policy": "mixed_fp8"}, ValueError, "autocast has no fp8 matmuls: .*"
                                          "matmul=fp8.*jmp_lab.fp8.dot_general"),
    ({"policy": "mixed_bfloat16,matmul=fp8_current"}, ValueError,
     "matmul=fp8_current"),
])
def test_bad_input_is_refused_with_a_message_naming_it(kwargs, error, match):
  args = {"fn": mlp, "policy": "mixed_bfloat16", **kwargs}
  with pytest.raises(error, match=match):
    jmp_lab.autocast(args.pop("fn"), args.pop("policy"), **args)


def test_scope_refuses_a_dtype_that_is_not_a_float():
  with pytest.raises(ValueError, match="int8"):
    jmp_lab.autocast.scope(jnp.int8)


def test_no_warning_on_reachable_code():
  params, x = mlp_params()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.grad(lambda p: jmp_lab.autocast(mlp, "mixed_bfloat16")(p, x).sum())(
        params)


def test_a_grouped_gemm_runs_in_the_compute_dtype_and_is_audited():
  """``lax.ragged_dot`` (a dropless mixture of experts' expert GEMMs) ran
  with fp32 operands under ``"mixed_bfloat16"``, and the audit did not list
  it: a model's largest GEMMs missing from its FLOP shares."""
  w = jax.random.normal(jax.random.key(0), (4, 64, 128))
  x = jax.random.normal(jax.random.key(1), (64, 64))
  group_sizes = jnp.array([8, 24, 16, 16], jnp.int32)

  def loss(w, x):
    return jnp.tanh(jax.lax.ragged_dot(x, w, group_sizes)).sum()

  step = jax.grad(jmp_lab.autocast(loss, "mixed_bfloat16"), argnums=(0, 1))
  grouped = [eqn for eqn in jax.make_jaxpr(step)(w, x).eqns
             if eqn.primitive.name == "ragged_dot_general"]
  assert len(grouped) == 3   # forward, input and weight gradients
  for eqn in grouped:
    assert [v.aval.dtype for v in eqn.invars[:2]] == [jnp.bfloat16] * 2
  report = audit_step(step, w, x)
  rows = [r for r in report.matmuls if r.kind == "ragged_dot"]
  # Each row meets one group's matrix: one dense product's FLOPs.
  assert [r.flops for r in rows] == [2.0 * 64 * 64 * 128] * 3
  assert report.half_flop_share == 1.0
  # The numbers: each group's rows times its own matrix, in bf16.
  bf16 = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
  starts = np.cumsum([0, 8, 24, 16])
  expected = jnp.concatenate([
      bf16(x[s:s + n]) @ bf16(w[g])
      for g, (s, n) in enumerate(zip(starts, [8, 24, 16, 16]))])
  got = jmp_lab.autocast(lambda w, x: jax.lax.ragged_dot(
      x, w, group_sizes), "mixed_bfloat16")(w, x)
  chex.assert_trees_all_close(got.astype(jnp.float32),
                              expected.astype(jnp.float32), rtol=1e-2)
