"""A 7B-class Llama, sharded as MaxText shards it, compiled for 8 GPUs.

The model is ``examples/fsdp_llama.py``'s ``LLAMA_7B``: 32 layers of 4096,
grouped-query attention (32 query, 8 KV heads), SwiGLU 11008, vocabulary
32000, sequences of 4096, the layers under ``nn.scan`` with remat, every
weight laid out by Flax's logical axes (``RULES``). Each configuration's
train step is compiled for ``devices`` x the target without a GPU (shapes
only: nothing is allocated) and a table gives, per device:

* arguments and temporaries (what must fit the GPU's memory);
* the optimizer state;
* the collectives' bytes by kind and dtype, and the loss's own all-reduce;
* a roofline model of the step (bytes at the memory bandwidth, GEMM FLOPs
  at the dense 16-bit peak; collectives taken as overlapped), and the MFU
  it implies: a model, not a measurement.

Run through ``benchmarks/train_step.py --llama7b`` (or this file)::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/train_step.py --llama7b
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/llama7b.py --fit
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jmp_lab
from jmp_lab.diagnostics import compiled

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "examples"))
import fsdp_llama  # noqa: E402

from benchmarks.train_step import largest_fitting  # noqa: E402

#: The dense 16-bit peak of an H100 SXM: the data sheet's (MaxText's MFU is
#: against it) and the one measured on the machines this project is lent
#: (a bf16 GEMM, about 790 TFLOP/s), with the measured copy bandwidth.
DATASHEET_PEAK = 989.4e12
MEASURED_PEAK = 790e12
MEASURED_BANDWIDTH = 3.0e12
#: NVLink 4, one direction, per GPU (data sheet): the collectives' model.
NVLINK_BANDWIDTH = 450e9
#: What a step may hold on an 80 GB H100 (the rest: CUDA, cuBLAS, NCCL).
FITS_BYTES = 76 * 2**30

_BF16_MOMENTS = dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
# Block-quantized 8-bit moments (jmp_lab.kernels.quantized).
_INT8_MOMENTS = dict(mu_dtype="int8", nu_dtype="int8")


@dataclasses.dataclass(frozen=True)
class Config:
  """A policy and an optimizer; ``fused`` holds ``fused_adamw``'s keyword
  arguments, None for ``mixed_precision(optax.adamw)``."""

  name: str
  policy: str
  fused: Optional[dict] = None

  def optimizer(self, lr: float = 3e-4):
    if self.fused is None:
      return jmp_lab.mixed_precision(optax.adamw(lr), policy=self.policy)
    return jmp_lab.fused_adamw(lr, policy=self.policy, **self.fused)


CONFIGS = (
    Config("mixed_bfloat16", "mixed_bfloat16"),
    Config("bf16-params", "p=bf16,c=bf16,o=f32", {}),
    Config("bf16-params+reduce-f32", "p=bf16,c=bf16,o=f32,reduce=float32", {}),
    Config("remainder-m16v16", "p=bf16,c=bf16,o=f32",
           dict(master="remainder", **_BF16_MOMENTS)),
    Config("none-sr-m16v16", "p=bf16,c=bf16,o=f32",
           dict(master="none", rounding="stochastic", **_BF16_MOMENTS)),
    Config("remainder-m8v8", "p=bf16,c=bf16,o=f32",
           dict(master="remainder", **_INT8_MOMENTS)),
    Config("none-sr-m8v8", "p=bf16,c=bf16,o=f32",
           dict(master="none", rounding="stochastic", **_INT8_MOMENTS)),
    Config("fp8-current", "p=bf16,c=bf16,o=f32,matmul=fp8_current", {}),
    # Blackwell's block-scaled matmuls (compile with --target b200).
    Config("mxfp8", "mixed_mxfp8"),
    Config("nvfp4", "mixed_nvfp4"),
    Config("fp8-delayed", "p=bf16,c=bf16,o=f32,matmul=fp8", {}),
)

#: The configurations the default run compiles (the fp8 ones on request).
DEFAULT_CONFIGS = tuple(c.name for c in CONFIGS if not c.name.startswith("fp8")
                        and "m8v8" not in c.name
                        and c.name not in ("mxfp8", "nvfp4"))

MESHES = ({"fsdp": 8}, {"fsdp": 4, "tensor": 2})


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled configuration's figures, per device."""

  config: str
  mesh: str
  sequences: int
  args_gib: float
  temp_gib: float
  optimizer_gib: float
  collectives: dict[str, float]   # "kind dtype" -> GB a step
  gathered_outside_loss: dict[str, float]  # all-gathers but the loss's: dtype -> GB
  loss_all_reduce_gb: float
  memory_s: float
  gemm_s: float
  model_flops: float              # per device, 6N per token + attention

  @property
  def args_temp_gib(self) -> float:
    return self.args_gib + self.temp_gib

  def step_seconds(self, peak: float, bandwidth: float) -> float:
    """The roofline at the given peak and bandwidth (the compiled report's
    times are at the data sheet's)."""
    return (self.memory_s * 3.35232e12 / bandwidth
            + self.gemm_s * DATASHEET_PEAK / peak)

  def mfu(self, peak: float, bandwidth: float) -> float:
    return self.model_flops / (peak * self.step_seconds(peak, bandwidth))

  def collective_seconds(self) -> float:
    return sum(self.collectives.values()) * 1e9 / NVLINK_BANDWIDTH


def model_flops(config: fsdp_llama.LlamaConfig, params: Any,
                tokens: int) -> float:
  """Training FLOPs as MaxText counts them: 6 per weight per token for the
  weights a token multiplies (the embedding table is a lookup, not a
  matmul), plus causal attention's 6 x layers x T x width per token."""
  weights = sum(int(np.prod(x.shape)) for path, x in
                jax.tree_util.tree_leaves_with_path(params)
                if "Embed" not in jax.tree_util.keystr(path))
  attention = 6 * config.layers * config.seq_len * config.width
  return float(tokens * (6 * weights + attention))


def _state_bytes_per_device(abstract: Any, layout: Any) -> int:
  """Bytes of ``abstract``'s arrays one device holds under ``layout``."""
  total = 0
  for leaf, sharding in zip(jax.tree_util.tree_leaves(abstract),
                            jax.tree_util.tree_leaves(layout)):
    shard = sharding.shard_shape(leaf.shape)
    total += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
  return total


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A compiled step: the report, the (unboxed, abstract) state, its layout
  and the model's config."""

  report: Any
  state: Any
  layout: Any
  model: fsdp_llama.LlamaConfig
  batch_size: int


def compile_step(config: Config, axes: dict[str, int], *, target: str = "h100",
                 sequences: int = 1, remat: str = "full",
                 model: fsdp_llama.LlamaConfig = fsdp_llama.LLAMA_7B,
                 flow: str = "jmp_lab") -> Compiled:
  """``config``'s train step on a mesh of ``axes`` compiled for ``target``,
  with ``sequences * devices`` sequences a step.

  ``flow`` lays the state out: ``"jmp_lab"`` by
  :func:`jmp_lab.sharding.state_shardings`, ``"flax"`` as Flax's sharding
  guide and MaxText do (the boxes' partition specs through the logical
  rules: ``nn.logical_to_mesh_sharding(nn.get_partition_spec(state))``).
  """
  devices = int(np.prod(list(axes.values())))
  mesh = compiled.gpu_mesh(target, devices, axes=axes)
  llama = dataclasses.replace(model, mesh=mesh, remat=remat != "none",
                              remat_policy=model.remat_policy
                              if remat == "none" else remat)
  module = jmp_lab.linen.with_policy(fsdp_llama.LlamaLM(llama), config.policy)
  rules = fsdp_llama.rules_for(mesh)
  batch_axes = dict(rules)["batch"]
  # ``sequences`` per device: the global batch is split over the batch's
  # axes, so a tensor-parallel group shares its sequences.
  batch_size = sequences * devices
  tokens = jnp.zeros((batch_size, llama.seq_len), jnp.int32)
  tx = config.optimizer()

  def init(key):
    variables = dict(module.init(key, tokens))
    params = variables.pop("params")   # the rest: an fp8 policy's state
    return jmp_lab.TrainState.create(apply_fn=module.apply, params=params,
                                     tx=tx, policy=config.policy,
                                     model_state=variables)

  with nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(init, jax.random.key(0))
  if flow == "flax":
    layout = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh,
                                         rules)
  elif flow == "jmp_lab":
    layout = jmp_lab.sharding.state_shardings(
        boxed, mesh, None, shard_optimizer_state=False, rules=rules)
  else:
    raise ValueError(f"flow must be 'jmp_lab' or 'flax', got {flow!r}")
  state = nn.unbox(boxed)
  step = jmp_lab.make_train_step(
      functools.partial(fsdp_llama.loss_fn,
                        vocab_shards=mesh.shape.get("tensor", 1)),
      state_sharding=layout, batch_sharding=NamedSharding(mesh, P(batch_axes)))
  specs = jax.tree_util.tree_map(lambda s: s.spec, layout)
  batch = jax.ShapeDtypeStruct((batch_size, llama.seq_len + 1), jnp.int32)
  with nn.logical_axis_rules(rules):
    report = compiled.compiled_report(
        step, state, batch, target=target, devices=devices, axes=axes,
        in_specs=(specs, P(batch_axes)), fail_on_spill=False)
  return Compiled(report, state, layout, llama, batch_size)


def _in_loss(collective) -> bool:
  return "linear_cross_entropy" in collective.op_name.split("/")


def gathered_outside_loss(report) -> dict[str, int]:
  """Bytes all-gathered a step by dtype, but for the loss's (the head's
  vocabulary shards): the weights of the model, each gather's operands."""
  gathered: dict[str, int] = {}
  for c in report.collectives:
    if c.kind == "all-gather" and not _in_loss(c):
      key = "/".join(c.dtypes)
      gathered[key] = gathered.get(key, 0) + c.bytes * c.times
  return gathered


def loss_all_reduce_bytes(report) -> int:
  """Bytes the loss all-reduces a step (its ops run under the
  ``linear_cross_entropy`` name scope)."""
  return sum(c.bytes * c.times for c in report.collectives
             if c.kind == "all-reduce" and _in_loss(c))


def row_of(config: Config, axes: dict[str, int], step: Compiled) -> Row:
  report, devices = step.report, int(np.prod(list(axes.values())))
  roof = report.roofline_seconds()
  return Row(
      config=config.name,
      mesh="×".join(f"{k}={v}" for k, v in axes.items()),
      sequences=step.batch_size // devices,
      args_gib=report.memory.get("argument", 0) / 2**30,
      temp_gib=report.memory.get("temp", 0) / 2**30,
      optimizer_gib=_state_bytes_per_device(step.state.opt_state,
                                            step.layout.opt_state) / 2**30,
      collectives={k: v / 1e9 for k, v in report.collective_bytes().items()},
      gathered_outside_loss={k: v / 1e9 for k, v in
                             gathered_outside_loss(report).items()},
      loss_all_reduce_gb=loss_all_reduce_bytes(report) / 1e9,
      memory_s=roof["memory"], gemm_s=roof["gemm"],
      model_flops=model_flops(step.model, step.state.params,
                              step.batch_size * step.model.seq_len) / devices)


def measure(config: Config, axes: dict[str, int], **kwargs) -> Row:
  """:func:`compile_step`'s figures as a table row."""
  return row_of(config, axes, compile_step(config, axes, **kwargs))


def table(rows: list[Row]) -> str:
  lines = [
      "| config | mesh | seqs/device | args+temp GiB | optimizer state GiB "
      "| all-gather GB (the model's weights') | reduce-scatter GB "
      "| all-reduce GB (loss's) "
      "| roofline s (memory + GEMM) | collectives s at NVLink "
      "| modelled MFU (data-sheet / measured peak) |",
      "|" + "---|" * 11]
  for r in rows:
    def kind(name):
      parts = [f"{dtypes} {gb:.2f}" for key, gb in sorted(r.collectives.items())
               for k, _, dtypes in [key.partition(" ")] if k == name]
      return ", ".join(parts) or "none"
    lines.append(
        f"| {r.config} | {r.mesh} | {r.sequences} | {r.args_temp_gib:.2f} "
        f"({r.args_gib:.2f} + {r.temp_gib:.2f}) | {r.optimizer_gib:.2f} "
        f"| {kind('all-gather')} ("
        + ", ".join(f"{k} {v:.3f}" for k, v in
                    sorted(r.gathered_outside_loss.items()) if v >= 5e-4)
        + f") | {kind('reduce-scatter')} "
        f"| {kind('all-reduce')} ({r.loss_all_reduce_gb:.3f}) "
        f"| {r.step_seconds(DATASHEET_PEAK, 3.35232e12):.3f} "
        f"({r.memory_s:.3f} + {r.gemm_s:.3f}) | {r.collective_seconds():.3f} "
        f"| {r.mfu(DATASHEET_PEAK, 3.35232e12):.0%} / "
        f"{r.mfu(MEASURED_PEAK, MEASURED_BANDWIDTH):.0%} |")
  return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[Row]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100",
                      choices=["h100", "h200", "b200"])
  parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                      help="of: " + ", ".join(c.name for c in CONFIGS))
  parser.add_argument("--meshes", default="fsdp=8;fsdp=4,tensor=2",
                      help="';'-separated meshes, each data=N,fsdp=N,tensor=N")
  parser.add_argument("--remat", default="full",
                      choices=["full", "selective", "none"])
  parser.add_argument("--sequences", type=int, default=1,
                      help="sequences of 4096 per device")
  parser.add_argument("--fit", action="store_true",
                      help="also: the most sequences per device that fit 76 "
                           "GiB with selective remat (fsdp=8), and the model "
                           "on one GPU with the remainder master")
  parser.add_argument("--flow", default="jmp_lab",
                      choices=["jmp_lab", "flax", "both"],
                      help="the state's layout: jmp_lab.sharding."
                           "state_shardings, Flax's guide (the boxes' specs), "
                           "or each in turn")
  parser.add_argument("--layers", type=int, help="fewer layers: a quick run")
  parser.add_argument("--seq-len", type=int, help="shorter sequences")
  args = parser.parse_args(argv)
  model = fsdp_llama.LLAMA_7B
  if args.layers:
    model = dataclasses.replace(model, layers=args.layers)
  if args.seq_len:
    model = dataclasses.replace(model, seq_len=args.seq_len)
  chosen = [c for c in CONFIGS if c.name in args.configs.split(",")]
  meshes = [fsdp_llama.parse_mesh(m) for m in args.meshes.split(";")]
  print(f"# {model.layers}-layer Llama ({args.remat} remat) compiled for "
        f"{args.target} without a GPU; jax {jax.__version__}")
  rows = []
  flows = ["jmp_lab", "flax"] if args.flow == "both" else [args.flow]
  for axes in meshes:
    for config in chosen:
      for flow in flows:
        start = time.time()
        row = measure(config, axes, target=args.target,
                      sequences=args.sequences, remat=args.remat, model=model,
                      flow=flow)
        if len(flows) > 1:
          row = dataclasses.replace(row, config=f"{config.name} ({flow})")
        rows.append(row)
        print(f"#   {row.config} on {row.mesh}: compiled in "
              f"{time.time() - start:.0f} s", flush=True)
  print(table(rows))
  if args.fit:
    rows += fit_report(chosen, args.target, model)
  return rows


def fit_report(chosen: list[Config], target: str,
               model: fsdp_llama.LlamaConfig) -> list[Row]:
  """The most sequences per device that fit with selective remat on fsdp=8,
  and the model fully fine-tuned on one GPU (remainder master, bf16
  moments)."""
  rows = []
  for config in chosen:
    found: dict[int, Row] = {}

    def fits(n, config=config, found=found):
      found[n] = measure(config, {"fsdp": 8}, target=target, sequences=n,
                              remat="selective", model=model)
      return found[n].args_temp_gib * 2**30 <= FITS_BYTES
    best = largest_fitting(fits, upper=32)
    print(f"# {config.name}, fsdp=8, selective remat: {best} sequences of "
          f"{model.seq_len} per device fit 76 GiB ("
          + ", ".join(f"{n}: {r.args_temp_gib:.1f} GiB"
                      for n, r in sorted(found.items())) + ")")
    if best:
      rows.append(found[best])
  one = next(c for c in CONFIGS if c.name == "remainder-m16v16")
  row = measure(one, {"fsdp": 1}, target=target, model=model)
  print(f"# one {target}, {one.name}, 1 sequence, full remat: args+temp "
        f"{row.args_temp_gib:.2f} GiB ({row.args_gib:.2f} + "
        f"{row.temp_gib:.2f}); fits 76 GiB: "
        f"{row.args_temp_gib * 2**30 <= FITS_BYTES}")
  rows.append(row)
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
