"""Tests for jmp_lab.policy: parsing, presets, round trips and casting."""

import types

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given

import jmp_lab
from jmp_lab.policy import half_dtype

F16, BF16, F32, F64 = (np.dtype(d) for d in
                       (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


# --- parsing ---------------------------------------------------------------


JMP_DTYPE_NAMES = ["bf16", "bfloat16", "f16", "float16", "full", "f32",
                   "float32", "f64", "float64", "half"]


@st.composite
def jmp_policy_strings(draw):
  """Strings in jmp's grammar: a bare dtype name or unique key=dtype pairs."""
  if draw(st.booleans()):
    return draw(st.sampled_from(JMP_DTYPE_NAMES))
  fields = draw(st.lists(st.sampled_from(["p", "c", "o"]), min_size=1,
                         max_size=3, unique=True))
  parts = []
  for field in fields:
    key = draw(st.sampled_from({"p": ["p", "params"], "c": ["c", "compute"],
                                "o": ["o", "output"]}[field]))
    parts.append(f"{key}={draw(st.sampled_from(JMP_DTYPE_NAMES))}")
  return ",".join(parts)


# --- bad input -------------------------------------------------------------


# --- casting ---------------------------------------------------------------


def mixed_tree():
  return {
      "w32": jnp.ones((2, 3), jnp.float32),
      "w16": jnp.ones((3,), jnp.float16),
      "step": jnp.array(7, jnp.int32),
      "mask": jnp.array([True, False]),
      "key": jax.random.key(0),
      "raw_key": jax.random.PRNGKey(1),  # legacy uint32 key
      "np": np.ones((2,), np.float32),
  }


class CastTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("float32", "mixed_bfloat16", "mixed_float16",
                            "p=bf16,c=f16,o=bf16")
  def test_casts_floating_leaves_only(self, spec):
    policy = jmp_lab.get_policy(spec)
    tree = mixed_tree()
    for cast, dtype in [(policy.cast_to_param, policy.param_dtype),
                        (policy.cast_to_compute, policy.compute_dtype),
                        (policy.cast_to_output, policy.output_dtype)]:
      out = self.variant(cast)(tree)
      chex.assert_type([out["w32"], out["w16"], out["np"]], [dtype] * 3)
      chex.assert_type([out["step"], out["mask"], out["raw_key"]],
                       [jnp.int32, jnp.bool_, jnp.uint32])
      assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
      chex.assert_trees_all_equal(out["step"], tree["step"])
      chex.assert_trees_all_equal(out["raw_key"], tree["raw_key"])
      chex.assert_trees_all_equal(
          jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
      chex.assert_trees_all_close(out["w32"].astype(jnp.float32),
                                  tree["w32"])

  def test_python_scalars_pass_through(self):
    policy = jmp_lab.get_policy("mixed_float16")
    tree = {"lr": 0.5, "n": 3, "flag": True, "none": None}
    assert policy.cast_to_compute(tree) == tree

  def test_same_dtype_leaf_is_not_copied(self):
    x = jnp.ones(3, jnp.float32)
    assert jmp_lab.get_policy("float32").cast_to_compute(x) is x


class PolicyParsingTest(chex.TestCase):

  @parameterized.parameters(*[
      ("float32", (F32, F32, F32)),
      ("mixed_bfloat16", (F32, BF16, F32)),
      ("mixed_float16", (F32, F16, F32)),
  ])
  def test_presets(self, name, expected):
    policy = jmp_lab.get_policy(name)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected

  @parameterized.parameters(*[
      ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
      ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
      ("c=f16", (F32, F16, F16)),             # params default f32; output follows compute
      ("p=bf16", (BF16, BF16, BF16)),         # compute follows params
      ("p=f16,c=bf16", (F16, BF16, BF16)),
      ("o=f16", (F32, F32, F16)),
      ("bf16", (BF16, BF16, BF16)),           # bare dtype name sets all three
      ("single", (F32, F32, F32)),
      ("full", (F32, F32, F32)),
      ("f64", (F64, F64, F64)),
      (" compute = bfloat16 , params = f32 ", (F32, BF16, BF16)),
  ])
  def test_parse(self, spec, expected):
    policy = jmp_lab.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected

  def test_policy_instance_passes_through(self):
    policy = jmp_lab.Policy("f32", "bf16", "f32")
    assert jmp_lab.get_policy(policy) is policy

  def test_half_is_float16_on_cpu(self):
    assert jmp_lab.get_policy("half").compute_dtype == F16

  @parameterized.parameters(*[
      ("tpu", None, BF16),
      ("gpu", "9.0", BF16),
      ("gpu", "8.0", BF16),
      ("gpu", "7.5", F16),
      ("gpu", None, F16),
      ("cpu", None, F16),
  ])
  def test_half_dtype_rule(self, platform, capability, expected):
    device = types.SimpleNamespace(platform=platform, compute_capability=capability)
    assert half_dtype(device) == expected

  @given(jmp_policy_strings())
  def test_agrees_with_jmp(self, spec):
    ours = jmp_lab.get_policy(spec)
    theirs = jmp.get_policy(spec)
    assert ours.param_dtype == np.dtype(theirs.param_dtype)
    assert ours.compute_dtype == np.dtype(theirs.compute_dtype)
    assert ours.output_dtype == np.dtype(theirs.output_dtype)

  @given(st.tuples(*[st.sampled_from([F16, BF16, F32, F64])] * 3),
         st.sampled_from([None, F16, BF16, F32]))
  def test_str_round_trips(self, dtypes, reduce_dtype):
    policy = jmp_lab.Policy(*dtypes, reduce_dtype=reduce_dtype)
    assert jmp_lab.get_policy(str(policy)) == policy

  @parameterized.parameters(*[
      ("params=float32,compute=bfloat16,output=float32,reduce=float32",
       (F32, BF16, F32, F32)),
      ("c=bf16,r=f32", (F32, BF16, BF16, F32)),
      ("mixed_bfloat16,reduce=f32", (F32, BF16, F32, F32)),
      ("mixed_float16, r=bf16", (F32, F16, F32, BF16)),
      ("mixed_bfloat16,c=f16", (F32, F16, F32, None)),
      ("p=bf16,c=bf16,o=f32", (BF16, BF16, F32, None)),
  ])
  def test_reduce_key(self, spec, expected):
    policy = jmp_lab.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype,
            policy.reduce_dtype) == expected
    assert jmp_lab.get_policy(str(policy)) == policy
    assert ("reduce=" in str(policy)) == (expected[3] is not None)

  @parameterized.parameters(*[
      ("mixed_fp8", (F32, BF16, F32, "fp8")),
      ("mixed_bfloat16,matmul=fp8", (F32, BF16, F32, "fp8")),
      ("c=bf16,o=f32,m=fp8_current", (F32, BF16, F32, "fp8_current")),
      ("mixed_bfloat16,reduce=f32,matmul=FP8", (F32, BF16, F32, "fp8")),
      # A bare dtype before keys (its error said "did you mean
      # 'bfloat16'?" of "bfloat16").
      ("bfloat16,matmul=mxfp8", (BF16, BF16, BF16, "mxfp8")),
      ("f16, m=nvfp4", (F16, F16, F16, "nvfp4")),
      ("bf16,o=f32", (BF16, BF16, F32, None)),
  ])
  def test_matmul_key(self, spec, expected):
    policy = jmp_lab.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype,
            policy.matmul) == expected
    assert jmp_lab.get_policy(str(policy)) == policy
    assert jmp_lab.get_policy("mixed_bfloat16").matmul is None

  def test_bad_matmul_mode(self):
    with pytest.raises(ValueError, match="matmul 'fp4'.*fp8, fp8_current"):
      jmp_lab.get_policy("mixed_bfloat16,matmul=fp4")
    with pytest.raises(ValueError, match="matmul 'int8'.*accepted: fp8"):
      jmp_lab.Policy(F32, BF16, F32, matmul="int8")

  @parameterized.product(name=list(jmp_lab.PRESETS))
  def test_preset_str_round_trips(self, name):
    policy = jmp_lab.get_policy(name)
    assert jmp_lab.get_policy(str(policy)) == policy

  @parameterized.parameters(*[
      ("", ["empty", "mixed_bfloat16"]),
      ("   ", ["empty"]),
      ("q=f32", ["'q'", "params", "compute", "output"]),
      ("p=f32,c=bf16,p=f16", ["duplicate", "'p'"]),
      ("params=f32,p=f16", ["duplicate", "'p'"]),
      ("c=float8", ["'float8'", "bfloat16", "half"]),
      ("int8", ["'int8'", "float32"]),
      ("c=int32", ["'int32'", "float16"]),
      ("p=f32,c", ["'c'", "key=dtype"]),
      ("f128", ["'f128'"]),
      ("mixed_bfloat16,r=f32,reduce=f16", ["duplicate", "'reduce'"]),
      ("c=bf16,r=int8", ["'int8'", "'r'"]),
      ("mixed_bfloat16,q=f32", ["'q'", "reduce"]),
  ])
  def test_bad_spec_raises_value_error(self, spec, must_mention):
    with pytest.raises(ValueError) as info:
      jmp_lab.get_policy(spec)
    for text in must_mention:
      assert text in str(info.value)

  def test_non_string_spec_raises_type_error(self):
    with pytest.raises(TypeError, match="Policy or a string"):
      jmp_lab.get_policy(16)

  @parameterized.product(dtype=[jnp.int8, jnp.int32, jnp.bool_, "int8"])
  def test_policy_rejects_non_floating_dtypes(self, dtype):
    with pytest.raises(ValueError, match="accepted"):
      jmp_lab.Policy(jnp.float32, dtype, jnp.float32)

  def test_policy_rejects_fp8_with_reason(self):
    with pytest.raises(ValueError, match="fp8"):
      jmp_lab.Policy(jnp.float32, jnp.float8_e4m3fn, jnp.float32)

  def test_policy_is_frozen_and_hashable(self):
    policy = jmp_lab.get_policy("mixed_float16")
    with pytest.raises(Exception):
      policy.compute_dtype = F32  # type: ignore[misc]
    assert hash(policy) == hash(jmp_lab.get_policy("p=f32,c=f16,o=f32"))
