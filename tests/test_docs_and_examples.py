"""The README's code and the examples run as written."""

import pathlib
import re
import runpy
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # README blocks run from the repository root


def python_blocks(path):
  return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def readme_python_blocks():
  return python_blocks(ROOT / "README.md")


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs(index, capsys):
  exec(compile(readme_python_blocks()[index], f"README block {index}", "exec"),
       {"__name__": "__readme__"})


DOC_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md")
                   if "_build" not in p.parts and python_blocks(p))


@pytest.mark.parametrize("page", DOC_PAGES,
                         ids=[str(p.relative_to(ROOT / "docs")) for p in DOC_PAGES])
def test_docs_page_python_blocks_run(page, capsys):
  """Every guide's code runs, its blocks in order in one namespace."""
  namespace = {"__name__": "__docs__"}
  for index, block in enumerate(python_blocks(page)):
    exec(compile(block, f"{page.name} block {index}", "exec"), namespace)


def test_readme_has_the_two_setup_commands_at_the_top():
  text = (ROOT / "README.md").read_text()
  head = text[:1600]
  assert 'pip install -e ".[examples]" && python examples/' in head
  assert 'pip install -e ".[dev]" &&' in head and "python -m pytest" in head
  assert len(text.splitlines()) <= 200


def test_the_clone_directory_the_readme_names_imports_the_installed_package(
    tmp_path):
  """The README's clone, seen from its parent directory (where a user runs a
  script next to it): ``import jmp_lab`` finds the installed package. A
  clone named ``jmp_lab`` was imported as an empty namespace package there
  (``AttributeError: module 'jmp_lab' has no attribute 'nnx'``)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  readme = (ROOT / "README.md").read_text()
  (directory,) = set(re.findall(r"git clone <[^>]+> (\S+) && cd (\S+?)`",
                                readme)[0])
  assert directory != "jmp_lab"
  (tmp_path / directory).symlink_to(ROOT)
  done = subprocess.run(
      [sys.executable, "-c", "import jmp_lab; print(jmp_lab.nnx.__name__)"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env={k: v for k, v in __import__("os").environ.items()
           if k != "PYTHONPATH"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "jmp_lab.nnx"


def test_readme_has_no_internal_wording():
  text = (ROOT / "README.md").read_text().lower()
  for phrase in ("seeds'", "the issue", "before the fix", "has been lent",
                 "as the library grows", "the target was"):
    assert phrase not in text, phrase


def test_an_examples_policy_typo_is_an_argparse_error(capsys):
  with pytest.raises(SystemExit) as exited:
    run_example("quickstart.py", "--policy", "mixed_bf16")
  assert exited.value.code == 2
  assert "did you mean 'mixed_bfloat16'?" in capsys.readouterr().err


def run_example(name, *args):
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    module = runpy.run_path(str(ROOT / "examples" / name))
    return module["main"](list(args))
  finally:
    sys.path.pop(0)


@pytest.mark.newest_lane
def test_quickstart_example_smoke():
  accuracy = run_example("quickstart.py", "--steps", "30")
  assert 0.0 <= accuracy <= 1.0


@pytest.mark.newest_lane
def test_digits_cnn_example_smoke(tmp_path):
  results = run_example("digits_cnn.py", "--epochs", "1", "--batch-size", "128",
                        "--no-progress", "--out-dir", str(tmp_path),
                        "--policy", "mixed_float16", "--loss-scale", "dynamic")
  (result,) = results
  assert result["test_accuracy"] > 0.3          # one short epoch
  assert result["peak_memory_bytes"] > 0 and result["steps_per_s"] > 0
  assert (tmp_path / "digits_cnn_mixed_float16_dynamic.png").stat().st_size > 10_000


@pytest.mark.newest_lane
def test_char_transformer_example_smoke_with_fused_fp16_and_resume(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  common = ["--data", str(text), "--policy", "mixed_float16", "--fused",
            "--batch-size", "4", "--seq-len", "32", "--sample-len", "8",
            "--no-progress", "--ckpt-dir", str(tmp_path / "ckpt")]
  first = run_example("char_transformer.py", "--steps", "3", *common)
  resumed = run_example("char_transformer.py", "--steps", "2", "--resume",
                        *common, "--sample-len", "0")
  assert first["step"] == 3 and resumed["step"] == 5
  assert int(resumed["state"].step) + int(resumed["state"].skipped_steps) == 5
  assert np.isfinite(resumed["valid_loss"]) and resumed["tokens_per_s"] > 0
  # fp16 matmuls are not quantized: one figure, reported under both names.
  assert resumed["valid_loss_bf16"] == resumed["valid_loss"]


@pytest.mark.floor_lane
def test_char_transformer_reports_nvfp4_weights_evaluated_with_bf16_matmuls(
    tmp_path):
  """Under a quantized policy the example also reports its trained weights'
  validation loss with bf16 matmuls (how well the format trained them),
  apart from the loss in its own policy (the forward quantized as in
  training). The figure is the bf16 model's loss on the same windows."""
  import jax
  import jmp_lab
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  result = run_example(
      "char_transformer.py", "--data", str(text), "--policy", "mixed_nvfp4",
      "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--sample-len",
      "0", "--no-progress", "--ckpt-dir", str(tmp_path / "ckpt"))
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    example = runpy.run_path(str(ROOT / "examples" / "char_transformer.py"))
  finally:
    sys.path.pop(0)
  tokens = example["load_tokens"](str(text))
  valid = example["validation_batch"](tokens[int(0.95 * len(tokens)):], 32)
  bf16_model = jmp_lab.linen.with_policy(
      example["CharTransformer"](max_len=32), "mixed_bfloat16")
  expected = jax.jit(lambda params: bf16_model.apply(
      {"params": params}, valid[:, :-1], targets=valid[:, 1:]).mean())(
          result["state"].params)
  np.testing.assert_allclose(result["valid_loss_bf16"], float(expected),
                             rtol=1e-5)
  # The NVFP4 forward's own figure is another number: its quantization.
  assert result["valid_loss_bf16"] != result["valid_loss"]
  assert abs(result["valid_loss_bf16"] / result["valid_loss"] - 1) < 0.05


def test_char_transformer_keeps_the_named_layers_bf16_and_resumes_only_so(
    tmp_path):
  """``--bf16-layers`` (a path override, as the NVFP4 paper keeps its last
  blocks in bf16) keeps those layers' matmuls bf16, and is recorded with the
  checkpoints: resuming without it is refused by name rather than silently
  training the block in 8 or 4 bits."""
  import jax
  import jax.numpy as jnp
  import jmp_lab
  from jmp_lab.diagnostics import audit_step
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    example = runpy.run_path(str(ROOT / "examples" / "char_transformer.py"))
  finally:
    sys.path.pop(0)
  parser = example["make_parser"]("char", str(tmp_path / "ckpt"))
  common = ["--policy", "mixed_mxfp8", "--ckpt-dir", str(tmp_path / "ckpt")]
  kept = parser.parse_args(common + ["--bf16-layers", "Block_1"])
  tokens = jnp.zeros((2, 32), jnp.int32)

  def block_scaled_matmuls(args):
    model = jmp_lab.linen.with_policy(
        example["CharTransformer"](max_len=32), args.policy,
        path_overrides=example["bf16_layers"](args))
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    audit = audit_step(lambda p: model.apply(p, tokens, targets=tokens).mean(),
                       params)
    return sum(r.kind == "mxfp8" for r in audit.matmuls)
  # Six Dense-like layers a block (q, k, v, out, and the MLP's two): the
  # first block's, of the two blocks' 12.
  assert block_scaled_matmuls(kept) == 6
  policy = jmp_lab.get_policy("mixed_mxfp8")
  example["checked_run_config"](kept, policy, resuming=False)
  with pytest.raises(ValueError, match="bf16_layers"):
    example["checked_run_config"](parser.parse_args(common), policy,
                                  resuming=True)


def test_char_transformer_size_flags_are_checked_and_kept_with_checkpoints(
    tmp_path, capsys):
  """--width/--depth/--heads (the block-scaled size study) are refused by
  name when they cannot build a model, and a checkpoint written at one size
  is not resumed at another."""
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    example = runpy.run_path(str(ROOT / "examples" / "char_transformer.py"))
  finally:
    sys.path.pop(0)
  for flags, message in ((["--width", "100", "--heads", "3"],
                           "--width 100 must be a multiple of --heads 3"),
                          (["--depth", "0"], "--depth must be at least 1")):
    with pytest.raises(SystemExit) as exited:
      example["main"](flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err
  parser = example["make_parser"]("char", str(tmp_path / "ckpt"))
  args = parser.parse_args(["--ckpt-dir", str(tmp_path / "ckpt")])
  policy = "mixed_nvfp4"
  args.width, args.depth, args.heads = 256, 2, 4
  assert example["checked_run_config"](args, policy, resuming=False)[
      "width"] == 256
  args.width = 128   # the default: not recorded, so not the saved config
  with pytest.raises(ValueError, match="width"):
    example["checked_run_config"](args, policy, resuming=True)


@pytest.mark.newest_lane
def test_char_transformer_nnx_example_smoke_with_remainder_and_resume(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  common = ["--data", str(text), "--policy", "p=bf16,c=bf16,o=f32",
            "--master", "remainder", "--fused", "--batch-size", "4",
            "--seq-len", "32", "--sample-len", "8", "--no-progress",
            "--ckpt-dir", str(tmp_path / "ckpt")]
  first = run_example("char_transformer_nnx.py", "--steps", "3", *common)
  resumed = run_example("char_transformer_nnx.py", "--steps", "2", "--resume",
                        *common, "--sample-len", "0")
  assert first["step"] == 3 and resumed["step"] == 5
  optimizer = resumed["optimizer"]
  assert int(optimizer.step[...]) + int(optimizer.skipped_steps) == 5
  assert np.isfinite(resumed["valid_loss"]) and resumed["tokens_per_s"] > 0


@pytest.mark.newest_lane
def test_autocast_equinox_example_smoke(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  result = run_example("autocast_equinox.py", "--data", str(text), "--steps",
                       "3", "--batch-size", "4", "--seq-len", "32",
                       "--no-progress")
  assert result["half_flop_share"] == 1.0
  assert np.isfinite(result["valid_loss"])


def test_autocast_equinox_example_block_scales_its_linears(tmp_path):
  """Equinox's ``Linear`` computes ``weight @ x``: under ``mixed_mxfp8``
  each is block-scaled (before, none was); attention's products stay bf16."""
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  result = run_example("autocast_equinox.py", "--data", str(text), "--steps",
                       "2", "--batch-size", "4", "--seq-len", "32",
                       "--no-progress", "--policy", "mixed_mxfp8")
  assert result["half_flop_share"] == 1.0
  # Every Linear; attention's two products of computed values stay bf16.
  assert 0.9 < result["block_scaled_flop_share"] < 1.0
  assert np.isfinite(result["valid_loss"])
