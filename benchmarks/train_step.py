"""End-to-end train-step benchmark: fp32 vs TF32 vs bf16 vs fp16, and torch AMP.

A decoder-only transformer in Flax linen (GPT-2-small-sized by default: 12
layers, d=768, 12 heads, sequence 1024, vocabulary 50304) on random tokens,
trained with jmp_lab policies (fp32 LayerNorm and softmax) and AdamW, each
configuration a jitted, donated train step:

  fp32-highest    fp32, jax_default_matmul_precision="highest"
  fp32-tf32       fp32, default matmul precision (TF32 on Ampere+)
  bf16            mixed_bfloat16
  fp16            mixed_float16 with dynamic loss scaling
  bf16-o2         bf16 params with fp32 master weights
  ...+fused       the last three with jmp_lab.fused_adamw

On a CUDA GPU with torch, the same architecture in PyTorch runs beside them:
autocast(bf16), autocast(fp16) + GradScaler, AdamW(fused=True), eager and
torch.compile.

Reported: median step time, tokens/s, MFU against the bf16 matmul peak
measured in the same run, peak device memory, the largest batch that fits
(fp32 vs bf16), the loss after the timed steps, and ratios against
fp32-highest, TF32 and the best torch AMP bf16. A plot goes to --plot.

  PYTHONPATH=. python benchmarks/train_step.py                 # GPU, GPT-2 small
  PYTHONPATH=. python benchmarks/train_step.py --small         # CPU-sized
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/train_step.py --target h100
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/train_step.py --target h100 \
      --devices 8 --configs bf16,fp16                           # data parallel
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/train_step.py --llama7b
      # a 7B-class Llama, fsdp=8 and fsdp=4 x tensor=2 (benchmarks/llama7b.py)

``--target`` needs no GPU: each configuration's step is compiled for that GPU
(``jmp_lab.diagnostics.compiled_report``, shapes only) and a table gives
bytes per step, kernels, argument+temporary memory per device, the GEMMs'
math (16-bit, tf32, fp32) by FLOP share, the collectives and a roofline lower
bound on the step time -- a model, not a measurement.

On a CPU the figures are a smoke test of the harness, not speed claims.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lab
from jmp_lab import linen as jl


@dataclasses.dataclass(frozen=True)
class ModelSize:
  layers: int = 12
  width: int = 768
  heads: int = 12
  seq_len: int = 1024
  vocab: int = 50304
  batch: int = 8


SMALL = ModelSize(layers=2, width=64, heads=2, seq_len=64, vocab=512, batch=4)


class Block(nn.Module):
  heads: int
  lean: bool = False

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    if self.lean:  # the fp32 softmax inside a fused kernel: no mask
      attention_fn, mask = functools.partial(jl.dot_product_attention,
                                             causal=True), None
    else:
      attention_fn = jl.dot_product_attention
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.heads, attention_fn=attention_fn)(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(h)))
    return x + h


class GPT(nn.Module):
  size: ModelSize
  # The lean step: fused attention and jmp_lab.losses.linear_cross_entropy;
  # called with targets, the model returns the per-token loss (the logits
  # are never stored).
  lean: bool = False

  @nn.compact
  def __call__(self, tokens, targets=None):
    s = self.size
    # Positions looked up per example, as Hugging Face's GPT-2 does: the
    # position table's gradient is then a scatter-add over the batch in the
    # embedding's dtype (the reduce dtype under a reduce policy), not a
    # broadcast's transpose in the compute dtype.
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = nn.Embed(s.vocab, s.width)(tokens) + nn.Embed(s.seq_len, s.width)(
        positions)
    mask = nn.make_causal_mask(tokens)
    for _ in range(s.layers):
      x = Block(s.heads, self.lean)(x, mask)
    x = nn.LayerNorm()(x)
    if not self.lean:
      return nn.Dense(s.vocab, use_bias=False)(x)
    # Kept as vocabulary rows, as an embedding table is: the loss reads its
    # blocks of rows, and kernel = head.T costs no transpose.
    head = self.param("lm_head", nn.initializers.lecun_normal(),
                      (s.vocab, s.width))
    if targets is None:
      return x @ head.T
    return jmp_lab.losses.linear_cross_entropy(x, head.T, targets)


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  policy: str
  loss_scale: str          # "none" or "dynamic"
  fused: bool = False
  precision: Optional[str] = None   # jax_default_matmul_precision
  flat: bool = False       # fused only: TrainState.create(flat_params=True)
  master: str = "float32"  # mixed_precision(master=...): memory-lean modes
  rounding: str = "nearest"
  mu_dtype: Optional[str] = None  # optax.adamw / fused_adamw(mu_dtype=...)
  nu_dtype: Optional[str] = None  # fused_adamw only (optax has none)
  lean: bool = False       # fused attention + linear_cross_entropy (issue 25)


CONFIGS = [
    Config("fp32-highest", "float32", "none", precision="highest"),
    Config("fp32-tf32", "float32", "none"),
    Config("bf16", "mixed_bfloat16", "none"),
    Config("fp16", "mixed_float16", "dynamic"),
    Config("bf16-o2", "p=bf16,c=bf16,o=f32", "none"),
    Config("bf16+fused", "mixed_bfloat16", "none", fused=True),
    Config("fp16+fused", "mixed_float16", "dynamic", fused=True),
    Config("bf16-o2+fused", "p=bf16,c=bf16,o=f32", "none", fused=True),
]


def loss_fn(params, state, batch):
  # model_state holds the fp8 scaling state under an fp8 policy (else {}).
  logits = state.apply_fn({"params": params, **state.model_state}, batch[:, :-1])
  loss = jl.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
  return loss


def lean_loss_fn(params, state, batch):
  """The lean step's loss: the model computes it from its last hidden
  states (``jmp_lab.losses.linear_cross_entropy``)."""
  return state.apply_fn({"params": params, **state.model_state},
                        batch[:, :-1], batch[:, 1:]).mean()


def loss_fn_of(config) -> Callable:
  return lean_loss_fn if config.lean else loss_fn


# The fused update with the params kept flat (issue 12's candidate):
# compiled-for-H100 only by default (--target), not part of the timed eight.
FLAT_CONFIGS = [
    Config("bf16+fused-flat", "mixed_bfloat16", "none", fused=True, flat=True),
    Config("bf16-o2+fused-flat", "p=bf16,c=bf16,o=f32", "none", fused=True,
           flat=True),
]


# Memory-lean masters (issue 13), bf16 params: compiled-for-H100 only.
LEAN_CONFIGS = [
    Config("bf16-o2-remainder", "p=bf16,c=bf16,o=f32", "none",
           master="remainder"),
    Config("bf16-o2-remainder-mu16", "p=bf16,c=bf16,o=f32", "none",
           master="remainder", mu_dtype="bfloat16"),
    Config("bf16-o2-none-sr", "p=bf16,c=bf16,o=f32", "none", master="none",
           rounding="stochastic"),
    Config("bf16-o2-none-sr-mu16", "p=bf16,c=bf16,o=f32", "none",
           master="none", rounding="stochastic", mu_dtype="bfloat16"),
    Config("bf16-o2+fused-remainder-m16v16", "p=bf16,c=bf16,o=f32", "none",
           fused=True, master="remainder", mu_dtype="bfloat16",
           nu_dtype="bfloat16"),
    Config("bf16-o2+fused-none-sr-m16v16", "p=bf16,c=bf16,o=f32", "none",
           fused=True, master="none", rounding="stochastic",
           mu_dtype="bfloat16", nu_dtype="bfloat16"),
]
# Gradients summed across devices in fp32 (issue 14): compile with --devices.
REDUCE_CONFIGS = [
    Config("bf16-r32", "mixed_bfloat16,reduce=float32", "none"),
    Config("bf16-o2-r32", "p=bf16,c=bf16,o=f32,reduce=float32", "none"),
    Config("bf16-o2-r32+fused", "p=bf16,c=bf16,o=f32,reduce=float32", "none",
           fused=True),
]
# fp8 matmuls (issue 16): the Dense layers as fp8 GEMMs, delayed or current
# scaling; attention's own two matmuls stay bf16.
FP8_CONFIGS = [
    Config("bf16-fp8", "mixed_fp8", "none"),
    Config("bf16-fp8-current", "mixed_bfloat16,matmul=fp8_current", "none"),
]
# The lean step (issue 25): cuDNN's fused attention on CUDA and the loss over
# vocabulary blocks; no stored (heads, T, T) scores or (tokens, vocab) logits.
LEAN_STEP_CONFIGS = [
    Config("bf16-lean", "mixed_bfloat16", "none", lean=True),
    # and with fp8 matmuls (issue 27): the GEMM-bound configuration's pair.
    Config("bf16-fp8-lean", "mixed_fp8", "none", lean=True),
]
# Blackwell's block-scaled matmuls (issue 55): every Dense GEMM (the head's
# too) MXFP8 or NVFP4; compiled for a B200 (benchmarks/block_scaled_compile.py).
BLOCK_SCALED_CONFIGS = [
    Config("bf16-mxfp8", "mixed_mxfp8", "none"),
    Config("bf16-nvfp4", "mixed_nvfp4", "none"),
]
# and the lean step's (fused attention, the loss over vocabulary blocks):
# the 1.3B-class GPT's comparison.
BLOCK_SCALED_LEAN_CONFIGS = [
    Config("bf16-mxfp8-lean", "mixed_mxfp8", "none", lean=True),
    Config("bf16-nvfp4-lean", "mixed_nvfp4", "none", lean=True),
]
ALL_CONFIGS = (CONFIGS + FLAT_CONFIGS + LEAN_CONFIGS + REDUCE_CONFIGS
               + FP8_CONFIGS + LEAN_STEP_CONFIGS + BLOCK_SCALED_CONFIGS
               + BLOCK_SCALED_LEAN_CONFIGS)


def make_state(config: Config, size: ModelSize):
  policy = jmp_lab.get_policy(config.policy)
  model = jl.with_policy(GPT(size, lean=config.lean), policy)
  # jit: one compile, where an eager init compiles each of its ~200 ops.
  variables = jax.jit(model.init)(jax.random.key(0),
                                  jnp.zeros((1, size.seq_len), jnp.int32))
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"}
  loss_scale = (jmp_lab.DynamicLossScale() if config.loss_scale == "dynamic"
                else jmp_lab.NoOpLossScale())
  if config.fused:
    tx = jmp_lab.fused_adamw(3e-4, weight_decay=0.1, policy=policy,
                             loss_scale=loss_scale,
                             layout="flat" if config.flat else "tree",
                             master=config.master, rounding=config.rounding,
                             mu_dtype=config.mu_dtype,
                             nu_dtype=config.nu_dtype)
  else:
    tx = jmp_lab.mixed_precision(
        optax.adamw(3e-4, weight_decay=0.1, mu_dtype=config.mu_dtype),
        policy=policy, loss_scale=loss_scale, master=config.master,
        rounding=config.rounding)
  return jmp_lab.TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                   policy=policy, flat_params=config.flat,
                                   model_state=model_state)


def compiled_step_report(config: Config, size: ModelSize, target: str,
                         devices: int = 1, zero1: bool = False,
                         fail_on_spill: bool = True):
  """The config's donated train step compiled for ``devices`` x ``target``.

  Shapes only: no parameter memory is allocated. With several devices the
  step is data parallel (params replicated, the batch split over "data");
  with ``zero1`` the optimizer state is split over "data" too
  (:func:`jmp_lab.sharding.state_shardings`).
  """
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jmp_lab.diagnostics import compiled, compiled_report
  with jax.default_matmul_precision(config.precision or "default"):
    state = jax.eval_shape(lambda: make_state(config, size))
    batch = jax.ShapeDtypeStruct((size.batch * devices, size.seq_len + 1),
                                 jnp.int32)
    if not zero1:
      return compiled_report(jmp_lab.make_train_step(loss_fn_of(config)),
                             state, batch, target=target, devices=devices,
                             in_specs=(P(), P("data")),
                             fail_on_spill=fail_on_spill)
    mesh = compiled.gpu_mesh(target, devices)
    layout = jmp_lab.sharding.state_shardings(state, mesh)
    step = jmp_lab.make_train_step(
        loss_fn_of(config), state_sharding=layout,
        batch_sharding=NamedSharding(mesh, P("data")))
    specs = jax.tree_util.tree_map(lambda s: s.spec, layout)
    return compiled_report(step, state, batch, target=target, devices=devices,
                           in_specs=(specs, P("data")),
                           fail_on_spill=fail_on_spill)


def param_count(size: ModelSize) -> int:
  """The model's parameters (shapes only)."""
  params = jax.eval_shape(lambda: GPT(size).init(
      jax.random.key(0), jnp.zeros((1, size.seq_len), jnp.int32)))["params"]
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def compiled_table(reports, params: int) -> str:
  """One row per config; the update columns are the ops under the train
  step's ``jmp_lab_update`` scope (kernel-boundary bytes, slices counted as
  read)."""
  lines = ["| config | GB/step | kernels | update kernels | update B/param "
           "| args+temp GiB/device | GEMM math (FLOP share) | fp32/tf32 GEMMs "
           "| collectives | Pallas kernel | roofline ms (model) |",
           "|" + "---|" * 11]
  for name, r in reports:
    update = r.scope(jmp_lab.training.UPDATE_SCOPE)
    math_share = ", ".join(
        f"{kind} {r.gemm_flop_share(kind):.0%}"
        for kind in ("fp8", "16-bit", "tf32", "fp32")
        if r.gemm_flop_share(kind))
    pallas = r.pallas_summary()
    moved = r.collective_bytes()
    collectives = ", ".join(f"{k} x{v} ({moved[k] / 1e6:.1f} MB)" for k, v in
                            sorted(r.collective_summary().items())) or "none"
    memory = r.memory.get("argument", 0) + r.memory.get("temp", 0)
    lines.append(
        f"| {name} | {r.bytes_accessed / 1e9:.1f} | {r.kernels} | "
        f"{update['kernels']} | {update['io_bytes'] / params:.1f} | "
        f"{memory / 2**30:.2f} | {math_share} | {len(r.fp32_gemms)} | "
        f"{collectives} | {pallas} | {r.roofline_seconds()['total'] * 1e3:.2f} |")
  return "\n".join(lines)


def random_batches(size: ModelSize, batch: int, count: int):
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.integers(0, size.vocab, (batch, size.seq_len + 1)),
                      jnp.int32) for _ in range(count)]


def median_step_seconds(run_step: Callable[[int], Any], *, warmup: int,
                        steps: int) -> tuple[float, Any]:
  out = None
  for i in range(warmup):
    out = run_step(i)
  jax.block_until_ready(out)
  times = []
  for i in range(steps):
    start = time.perf_counter()
    out = run_step(warmup + i)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def compiled_peak_bytes(step, state, batch) -> int:
  return jmp_lab.diagnostics.compiled_memory(
      step.lower(state, batch).compile())["peak"]


def device_memory_limit() -> Optional[int]:
  return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def run_jax(config: Config, size: ModelSize, *, warmup: int, steps: int) -> dict:
  with jax.default_matmul_precision(config.precision or "default"):
    state = make_state(config, size)
    step = jmp_lab.make_train_step(loss_fn_of(config))
    batches = random_batches(size, size.batch, 4)
    flops = jmp_lab.diagnostics.audit_step(step, state, batches[0]).total_flops
    peak_estimate = compiled_peak_bytes(step, state, batches[0])
    holder = [state]

    def run_step(i):
      holder[0], metrics = step(holder[0], batches[i % len(batches)])
      return metrics

    seconds, metrics = median_step_seconds(run_step, warmup=warmup, steps=steps)
  stats = jax.local_devices()[0].memory_stats() or {}
  return {"name": config.name, "seconds": seconds, "flops": flops,
          "loss": float(metrics["loss"]),
          "peak_bytes": stats.get("peak_bytes_in_use", peak_estimate),
          "peak_source": "device" if "peak_bytes_in_use" in stats else "compiled"}


def largest_batch(config: Config, size: ModelSize, limit: int,
                  upper: int = 4096) -> int:
  """The largest batch whose compiled step fits in ``limit`` bytes (bisection)."""
  with jax.default_matmul_precision(config.precision or "default"):
    state = make_state(config, size)
    step = jmp_lab.make_train_step(loss_fn_of(config))

    def fits(batch):
      tokens = jax.ShapeDtypeStruct((batch, size.seq_len + 1), jnp.int32)
      try:
        return compiled_peak_bytes(step, state, tokens) <= limit
      except Exception:  # pylint: disable=broad-except  (compile-time OOM)
        return False

    return largest_fitting(fits, upper)


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
  """The largest ``n <= upper`` with ``fits(n)``, for monotone ``fits``.

  Doubles until a batch does not fit, then bisects: O(log n) compiles.
  Returns 0 if even 1 does not fit.
  """
  low, high = 0, 1
  while high <= upper and fits(high):
    low, high = high, high * 2
  high = min(high, upper + 1)
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low


def bf16_matmul_peak(n: int, repeats: int = 10) -> float:
  """Measured bf16 matmul FLOP/s on random data (the MFU denominator)."""
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: a @ b)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / statistics.median(times)


#: The torch peers ``--torch-peers`` chooses from: AMP dtype, then
#: ``-compile`` (torch.compile) and ``-sdpa`` (torch's fused attention).
TORCH_PEERS = ("bf16", "bf16-compile", "fp16", "fp16-compile", "bf16-sdpa",
               "bf16-sdpa-compile")


def run_torch_peer(size: ModelSize, peer: str, *, warmup: int,
                   steps: int) -> Optional[dict]:
  """The torch peer named ``peer`` (one of :data:`TORCH_PEERS`)."""
  if peer not in TORCH_PEERS:
    raise ValueError(f"unknown torch peer {peer!r}; accepted: "
                     f"{', '.join(TORCH_PEERS)}")
  return run_torch(size, dtype_name=peer.split("-")[0],
                   compiled=peer.endswith("-compile"), sdpa="-sdpa" in peer,
                   warmup=warmup, steps=steps)


def run_torch(size: ModelSize, *, dtype_name: str, compiled: bool,
              warmup: int, steps: int, sdpa: bool = False) -> Optional[dict]:
  """The same architecture in PyTorch AMP (CUDA only); None if unavailable.
  With ``sdpa``, its attention is torch's fused
  ``scaled_dot_product_attention``."""
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  from benchmarks import torch_gpt
  model = torch_gpt.GPT(size, sdpa=sdpa).cuda()
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
  dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
  scaler = torch.amp.GradScaler("cuda", enabled=dtype_name == "fp16")
  forward = torch.compile(model) if compiled else model
  tokens = torch.randint(0, size.vocab, (size.batch, size.seq_len + 1), device="cuda")

  def run_step(_):
    with torch.autocast("cuda", dtype=dtype):
      logits = forward(tokens[:, :-1])
      loss = torch.nn.functional.cross_entropy(
          logits.float().reshape(-1, size.vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss

  torch.cuda.reset_peak_memory_stats()
  for i in range(warmup):
    run_step(i)
  torch.cuda.synchronize()
  times, loss = [], None
  for i in range(steps):
    start = time.perf_counter()
    loss = run_step(i)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  return {"name": (f"torch {dtype_name}{' sdpa' if sdpa else ''}"
                   f"{' compile' if compiled else ''}"),
          "seconds": statistics.median(times), "flops": None,
          "loss": float(loss), "peak_bytes": torch.cuda.max_memory_allocated(),
          "peak_source": "device"}


def model_flops(size: ModelSize) -> float:
  """The train step's matmul FLOPs, from the traced bf16 step (shapes only:
  nothing is allocated, so the torch-only process can ask)."""
  config = next(c for c in CONFIGS if c.name == "bf16")
  state = jax.eval_shape(lambda: make_state(config, size))
  batch = jax.ShapeDtypeStruct((size.batch, size.seq_len + 1), jnp.int32)
  return jmp_lab.diagnostics.audit_step(jmp_lab.make_train_step(loss_fn),
                                        state, batch).total_flops


def table(rows, size: ModelSize, peak_flops: float) -> str:
  tokens = size.batch * size.seq_len
  by_name = {r["name"]: r for r in rows}
  torch_bf16 = [r for r in rows if r["name"].startswith("torch bf16")]
  best_torch = min(torch_bf16, key=lambda r: r["seconds"]) if torch_bf16 else None
  jax_flops = next((r["flops"] for r in rows if r["flops"]), None) or (
      model_flops(size))
  lines = ["| config | median step ms | tokens/s | MFU | peak MiB | loss "
           "| vs fp32-highest | vs TF32 | vs torch bf16 |", "|" + "---|" * 9]
  for r in rows:
    flops = r["flops"] or jax_flops  # same model, same FLOPs
    ratio = lambda ref: (f"{ref['seconds'] / r['seconds']:.2f}x"  # noqa: E731
                         if ref else "n/a")
    lines.append(
        f"| {r['name']} | {1e3 * r['seconds']:.2f} | {tokens / r['seconds']:,.0f} "
        f"| {flops / r['seconds'] / peak_flops:.1%} "
        f"| {r['peak_bytes'] / 2**20:,.0f} ({r['peak_source']}) | {r['loss']:.4f} "
        f"| {ratio(by_name.get('fp32-highest'))} | {ratio(by_name.get('fp32-tf32'))} "
        f"| {ratio(best_torch)} |")
  return "\n".join(lines)


def write_json(path: str, rows, size: ModelSize, peak_flops: float,
               device: str) -> None:
  """The timed rows (name, median seconds, FLOPs, loss, peak bytes), the
  model, its tokens a step and the measured bf16 matmul peak."""
  jax_flops = next((r["flops"] for r in rows if r["flops"]), None)
  with open(path, "w") as f:
    json.dump({"device": device, "jax": jax.__version__,
               "model": dataclasses.asdict(size),
               "tokens_per_step": size.batch * size.seq_len,
               "measured_bf16_peak_flops": peak_flops,
               "model_flops": jax_flops or model_flops(size),
               "rows": rows}, f, indent=1)


def plot(rows, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(9, 3.5))
  names = [r["name"] for r in rows]
  ax.barh(names, [1e3 * r["seconds"] for r in rows], color="tab:blue")
  ax.set(xlabel="median step time (ms)", title="train step, lower is better")
  ax.invert_yaxis()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  on_gpu = jax.default_backend() == "gpu"
  parser.add_argument("--small", action="store_true", default=not on_gpu,
                      help="a tiny model (default on CPU)")
  parser.add_argument("--layers", type=int)
  parser.add_argument("--width", type=int)
  parser.add_argument("--heads", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--vocab", type=int)
  parser.add_argument("--batch", type=int)
  parser.add_argument("--warmup", type=int, default=5 if on_gpu else 1)
  parser.add_argument("--steps", type=int, default=30 if on_gpu else 3)
  parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
  parser.add_argument("--no-batch-search", action="store_true")
  parser.add_argument("--batch-search-configs", default="fp32-tf32,bf16",
                      help="on a GPU: the configs whose largest batch that "
                           "fits is searched")
  parser.add_argument("--no-torch", action="store_true",
                      help="time jax only")
  parser.add_argument("--torch-only", action="store_true",
                      help="time the torch peers only (the GPU script runs "
                           "them in a process of their own, so that jax's "
                           "allocator does not hold memory torch needs)")
  parser.add_argument("--torch-peers", default="bf16,bf16-compile,fp16,"
                      "fp16-compile",
                      help="the torch peers timed, of: " + ", ".join(
                          TORCH_PEERS))
  parser.add_argument("--json", default=None,
                      help="also write the rows, the model and the measured "
                           "peak to this JSON file (benchmarks/timings.py "
                           "reads it)")
  parser.add_argument("--plot", default=None)
  parser.add_argument("--target", choices=["h100", "h200"],
                      help="compile for this GPU (no GPU needed) and print "
                           "the compiled table instead of timing")
  parser.add_argument("--devices", type=int, default=1,
                      help="with --target: GPUs, data parallel")
  parser.add_argument("--zero1", action="store_true",
                      help="with --target and --devices: the optimizer state "
                           "split over the devices (ZeRO-1)")
  parser.add_argument("--llama7b", action="store_true",
                      help="the 7B-class Llama, FSDP and tensor parallel, "
                           "compiled for 8 GPUs: the other arguments go to "
                           "benchmarks/llama7b.py (--help there)")
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--llama7b" in argv:  # every other argument is llama7b.py's
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama7b  # pylint: disable=import-outside-toplevel
    return llama7b.main([a for a in argv if a != "--llama7b"])
  args = parser.parse_args(argv)

  small = args.small and not args.target  # --target means GPT-2 small
  size = SMALL if small else ModelSize()
  size = dataclasses.replace(size, **{k: v for k, v in vars(args).items()
                                      if k in ModelSize.__dataclass_fields__ and v})
  chosen = [c for c in ALL_CONFIGS
            if c.name in args.configs.split(",")]
  if args.target:
    print(f"# compiled for {args.devices} x {args.target} without a GPU; jax "
          f"{jax.__version__}; model {size}")
    reports = []
    for c in chosen:
      reports.append((c.name + ("+zero1" if args.zero1 else ""),
                      compiled_step_report(c, size, args.target,
                                           args.devices, args.zero1)))
    print(compiled_table(reports, param_count(size)))
    return reports
  device = jax.local_devices()[0]
  peak = bf16_matmul_peak(8192 if on_gpu else 512)
  print(f"# {device.device_kind}; jax {jax.__version__}; model {size}; "
        f"measured bf16 matmul peak {peak / 1e12:.1f} TFLOP/s")
  rows = [] if args.torch_only else [
      run_jax(c, size, warmup=args.warmup, steps=args.steps) for c in chosen]
  if on_gpu and not args.no_torch:
    for peer in args.torch_peers.split(","):
      row = run_torch_peer(size, peer, warmup=args.warmup, steps=args.steps)
      if row:
        rows.append(row)
  print(table(rows, size, peak))
  if args.json:
    write_json(args.json, rows, size, peak, device.device_kind)
  limit = device_memory_limit()
  if limit and not args.no_batch_search and not args.torch_only:
    for name in args.batch_search_configs.split(","):
      config = next(c for c in ALL_CONFIGS if c.name == name)
      print(f"largest batch that fits, {name}: {largest_batch(config, size, limit)}")
  if args.plot:
    plot(rows, args.plot)
  return rows


if __name__ == "__main__":
  main()
