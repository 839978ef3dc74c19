"""Benchmark: the fused AdamW update against the unfused jitted path.

Prints, for each size, a table of:

* ``fused tree (new params)`` -- ``jmp_lab.fused_adamw`` with its default
  ``layout="tree"``: the multi-tensor kernels over the leaves as they are,
  taking the new params from the kernel as ``TrainState`` does
  (``update.new_params``), in one jitted, donated step;
* ``fused tree (updates + apply_updates)`` -- the same through the optax API;
* ``fused flat (tree grads)`` -- ``layout="flat"``, gradients arriving as a
  tree (so packed first), + ``optax.apply_updates``;
* ``fused flat (flat params)`` -- the same step with params and gradients in
  the flat form (``jmp_lab.flat_params``);
* ``fused flat kernel alone`` -- just the flat kernel on pre-packed buffers;
* ``unfused`` -- ``mixed_precision(optax.adamw(...))`` + ``apply_updates``;
* ``torch fused AdamW`` -- on a CUDA GPU with torch: ``AdamW(fused=True)``
  stepped through ``torch.amp.GradScaler`` (fp32 params and grads, as AMP
  keeps them);
* ``copy`` -- ``y = x + 1`` over an fp32 buffer, the device's streaming
  bandwidth, measured in the same run.

Columns: median time, the bytes each path must move per parameter (a model:
``fused`` reads p, m, v, g = 14 B and writes p, m, v and the half copy = 14 B,
plus 2 B for the finite-flag pass), the GB/s that implies, the fraction of the
measured copy bandwidth, and the time ratio to ``fused (tree grads)``.

Usage::

  PYTHONPATH=. python benchmarks/fused_update.py                # GPU sizes
  PYTHONPATH=. python benchmarks/fused_update.py --sizes 1M,4M  # CPU-sized
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/fused_update.py --target h100

``--target h100`` (or ``h200``) needs no GPU: it compiles each path's donated
step for that GPU (``jmp_lab.diagnostics.compiled_report``) and prints bytes
per step and per parameter (XLA's cost model plus the custom calls' operand
and result bytes), kernels launched, argument+temporary memory, the Pallas
kernel's registers and spills, and the summed roofline (bytes plus GEMM
math) -- a model, not a measurement.

Timings are medians of ``--repeats`` device-synchronised runs after
``--warmup`` runs. On a CPU the numbers are ratios of the reference backend,
not speed claims.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lab
from jmp_lab.kernels import layout as flat_layout

FUSED_BYTES = 14 + 14 + 2            # read p m v g, write p m v half, flag
UNFUSED_BYTES_MIN = FUSED_BYTES      # the same data; XLA may move more
TORCH_BYTES = 16 + 12 + 4 + 4 + 4    # step r/w, unscale r/w, inf check
#: The row name of torch's peer (benchmarks/timings.py looks it up).
TORCH_PATH = "torch AdamW(fused) + GradScaler"


def parse_size(text: str) -> int:
  units = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
  text = text.strip().upper()
  return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def median_seconds(fn, *, warmup: int, repeats: int) -> float:
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def make_params(size: int, dtype, leaves: int = 16):
  """``size`` parameters split over ``leaves`` leaves of uneven size."""
  key = jax.random.key(0)
  cuts = np.linspace(0, size, leaves + 1).astype(int)
  return {f"w{i}": (jax.random.normal(jax.random.fold_in(key, i),
                                      (int(cuts[i + 1] - cuts[i]),)) * 0.02
                    ).astype(dtype) for i in range(leaves)}


def scaled(grads):
  """The gradients as jmp_lab's train steps hand them to its optimizers:
  marked as the scaled loss's, so the update unscales them (plain ones
  would be taken as unscaled, with a warning)."""
  return jmp_lab.ScaledGradients(grads)


def time_optimizer(tx, params, grads, *, warmup, repeats, state=None):
  """Median seconds of one donated ``update + apply_updates`` step."""

  def step(params, state, grads):
    updates, state = tx.update(scaled(grads), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  params = jax.tree_util.tree_map(jnp.copy, params)  # the caller keeps its own
  carry = [params, tx.init(params) if state is None else state]

  def run():
    carry[0], carry[1] = step(carry[0], carry[1], grads)
    jax.block_until_ready(carry)

  return median_seconds(run, warmup=warmup, repeats=repeats)


def time_new_params(tx, params, grads, *, warmup, repeats):
  """Median seconds of one donated step taking the new params from the
  kernel (``update.new_params``), as ``TrainState`` does."""
  step = jax.jit(_new_params_step(tx), donate_argnums=(0, 1))
  params = jax.tree_util.tree_map(jnp.copy, params)
  carry = [params, tx.init(params)]

  def run():
    carry[0], carry[1] = step(carry[0], carry[1], grads)
    jax.block_until_ready(carry)

  return median_seconds(run, warmup=warmup, repeats=repeats)


def time_flat_step(tx, params, grads, *, warmup, repeats):
  """The whole donated step with params and gradients in the flat form."""
  state = tx.init(params)
  flat = jmp_lab.flat_params(state, params)
  flat_grads = jmp_lab.flat_params(state, grads)
  return time_optimizer(tx, flat, flat_grads, warmup=warmup,
                        repeats=repeats, state=state)


def xla_bytes_per_param(tx, params, grads, state=None) -> float:
  """XLA's cost-model estimate of bytes accessed by one step, per parameter.

  Device-independent evidence of how many passes a path makes. Pallas custom
  calls are opaque to it, so it is reported for the reference backend only.
  """
  state = tx.init(params) if state is None else state

  def step(params, state, grads):
    updates, state = tx.update(scaled(grads), state, params)
    return optax.apply_updates(params, updates), state

  cost = jax.jit(step).lower(params, state, grads).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  size = sum(x.size for x in jax.tree_util.tree_leaves(params))
  return float(cost.get("bytes accessed", float("nan"))) / size


def time_flat_kernel(tx, params, grads, *, warmup, repeats):
  """The fused kernel alone, on gradients packed once beforehand."""
  state = tx.init(params)
  layout = state.layout
  flat_grads = flat_layout.pack(layout, grads, grads[next(iter(grads))].dtype)
  backend = "auto"
  config = jmp_lab.kernels.AdamWConfig(0.9, 0.999, 1e-8, 1e-4,
                                       np.dtype(flat_grads.dtype))
  hyper = jnp.array([1e-4, 10.0, 1000.0, 1.0, 1.0], jnp.float32)
  flags = jnp.array([1, layout.decay_boundary], jnp.int32)

  def kernel(g, p, mu, nu):
    return jmp_lab.kernels.fused_update(backend, config, g, p, mu, nu, hyper,
                                        flags)

  kernel = jax.jit(kernel, donate_argnums=(1, 2, 3))
  carry = [state.master_params, state.mu, state.nu]

  def run():
    out = kernel(flat_grads, *carry)
    carry[:] = [out.master, out.mu, out.nu]
    jax.block_until_ready(out)

  return median_seconds(run, warmup=warmup, repeats=repeats)


def time_copy(size, *, warmup, repeats):
  x = jnp.ones((size,), jnp.float32)
  add_one = jax.jit(lambda x: x + 1)
  return median_seconds(lambda: add_one(x).block_until_ready(),
                        warmup=warmup, repeats=repeats)


def time_torch(size, *, warmup, repeats):
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  params = [torch.nn.Parameter(torch.randn(size, device="cuda") * 0.02)]
  params[0].grad = torch.randn(size, device="cuda") * 1024
  opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, fused=True)
  scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=10**9)

  def run():
    scaler.step(opt)
    scaler.update()
    torch.cuda.synchronize()

  return median_seconds(run, warmup=warmup, repeats=repeats)


def fits(size: int) -> bool:
  """Whether ~60 B/param (state, grads, params, temporaries) fits."""
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  if limit is None:  # CPU: use a third of RAM
    import os
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3
  return size * 60 < limit


def _update_step(tx, mark=scaled):
  def step(params, state, grads):
    updates, state = tx.update(mark(grads), state, params)
    return optax.apply_updates(params, updates), state
  return step


def _new_params_step(tx):
  def step(params, state, grads):
    return tx.update.new_params(scaled(grads), state, params)
  return step


def compiled_rows(size: int, dtype, target: str, leaves: int = 16):
  """``(path, CompiledReport)`` for each update path, compiled for ``target``.

  Everything is abstract (shapes only): no parameter memory is allocated.
  """
  from jmp_lab.diagnostics import compiled_report
  policy = jmp_lab.Policy(dtype, dtype, jnp.float32)
  params = jax.eval_shape(lambda: make_params(size, dtype, leaves))
  grads = params
  loss_scale = jmp_lab.StaticLossScale(1024.0)
  tree = jmp_lab.fused_adamw(1e-4, policy=policy, loss_scale=loss_scale)
  tree_state = jax.eval_shape(tree.init, params)
  fused = jmp_lab.fused_adamw(1e-4, policy=policy, loss_scale=loss_scale,
                              layout="flat")
  unfused = jmp_lab.mixed_precision(optax.adamw(1e-4), policy=policy,
                                    loss_scale=loss_scale)
  params32 = jax.tree_util.tree_map(
      lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
  fused_state = jax.eval_shape(fused.init, params)
  flat = jax.eval_shape(lambda s, p: jmp_lab.flat_params(s, p), fused_state,
                        params)
  hyper = jax.ShapeDtypeStruct((5,), jnp.float32)
  flags = jax.ShapeDtypeStruct((2,), jnp.int32)
  config = jmp_lab.kernels.AdamWConfig(0.9, 0.999, 1e-8, 1e-4, dtype)

  def kernel(g, p, mu, nu, hyper, flags):
    return jmp_lab.kernels.fused_update("auto", config, g, p, mu, nu, hyper,
                                        flags)

  donate = dict(donate_argnums=(0, 1))
  return [
      ("fused tree (new params)", compiled_report(
          _new_params_step(tree), params, tree_state, grads, target=target,
          **donate)),
      ("fused tree (updates + apply_updates)", compiled_report(
          _update_step(tree), params, tree_state, grads, target=target,
          **donate)),
      ("fused flat (tree grads)", compiled_report(
          _update_step(fused), params, fused_state, grads, target=target,
          **donate)),
      ("fused flat (flat params)", compiled_report(
          _update_step(fused), flat, fused_state, flat, target=target,
          **donate)),
      ("fused flat kernel alone", compiled_report(
          kernel, flat, fused_state.master_params, fused_state.mu,
          fused_state.nu, hyper, flags, target=target,
          donate_argnums=(1, 2, 3))),
      ("unfused mixed_precision(adamw)", compiled_report(
          _update_step(unfused), params, jax.eval_shape(unfused.init, params),
          grads, target=target, **donate)),
      ("plain optax.adamw, fp32 params", compiled_report(
          _update_step(optax.adamw(1e-4), mark=lambda g: g), params32,
          jax.eval_shape(optax.adamw(1e-4).init, params32), params32,
          target=target, **donate)),
  ]


def compiled_table(size: int, rows) -> str:
  lines = ["| params | path | GB/step | B/param | kernels | args+temp MiB "
           "| Pallas kernel | roofline us (model) |", "|" + "---|" * 8]
  for name, report in rows:
    moved = report.bytes_accessed
    memory = report.memory.get("argument", 0) + report.memory.get("temp", 0)
    pallas = ", ".join(f"{k.backend} {k.registers} regs, {k.spill_bytes} B spill"
                       for k in report.pallas_kernels) or "none"
    lines.append(
        f"| {size:,} | {name} | {moved / 1e9:.3f} | {moved / size:.1f} | "
        f"{report.kernels} | {memory / 2**20:,.0f} | {pallas} | "
        f"{report.roofline_seconds()['total'] * 1e6:.0f} |")
  return "\n".join(lines)


def main_compiled(args) -> None:
  dtype = np.dtype(jnp.dtype(args.param_dtype))
  print(f"# compiled for {args.target} without a GPU; jax {jax.__version__}; "
        f"params {dtype.name}, {args.leaves} leaves; fused backend auto -> "
        f"{jmp_lab.kernels.cuda_backend()}")
  for size in map(parse_size, args.sizes.split(",")):
    print(compiled_table(size, compiled_rows(size, dtype, args.target,
                                             args.leaves)))
    sys.stdout.flush()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  on_gpu = jax.default_backend() == "gpu"
  parser.add_argument("--sizes", default="10M,100M,1B" if on_gpu else "1M,4M")
  parser.add_argument("--param-dtype", default="bfloat16",
                      choices=["bfloat16", "float16"])
  parser.add_argument("--warmup", type=int, default=5 if on_gpu else 2)
  parser.add_argument("--repeats", type=int, default=50 if on_gpu else 7)
  parser.add_argument("--target", choices=["h100", "h200"],
                      help="compile for this GPU (no GPU needed) and print "
                           "the compiled tables instead of timing")
  parser.add_argument("--leaves", type=int, default=16)
  parser.add_argument("--no-torch", action="store_true",
                      help="time jax only")
  parser.add_argument("--torch-only", action="store_true",
                      help="time torch's fused AdamW only (the GPU script "
                           "runs it in a process of its own)")
  parser.add_argument("--json", default=None,
                      help="also write the timed rows to this JSON file "
                           "(benchmarks/timings.py reads it)")
  args = parser.parse_args(argv)
  if args.target:
    if argv is None and "--sizes" not in sys.argv:
      args.sizes = "10M,100M,1B"
    return main_compiled(args)

  dtype = np.dtype(jnp.dtype(args.param_dtype))
  policy = jmp_lab.Policy(dtype, dtype, jnp.float32)
  device = jax.local_devices()[0]
  print(f"# device: {device.device_kind} ({device.platform}); jax "
        f"{jax.__version__}; params {dtype.name}; fused backend "
        f"auto ({jmp_lab.kernels.cuda_backend()} when compiled for CUDA, "
        f"reference elsewhere)")
  print("| params | path | median ms | B/param | GB/s | of copy BW | time / fused |")
  print("|---|---|---|---|---|---|---|")
  timed = []  # {"params", "path", "seconds", "bytes_per_param"}
  for size in map(parse_size, args.sizes.split(",")):
    if not fits(size):
      print(f"| {size:,} | skipped: does not fit in device memory | | | | | |")
      continue
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    if args.torch_only:
      torch_s = time_torch(size, **timing)
      if torch_s is not None:
        print(f"| {size:,} | torch AdamW(fused) + GradScaler | "
              f"{torch_s * 1e3:.3f} | {TORCH_BYTES} | "
              f"{TORCH_BYTES * size / torch_s / 1e9:.1f} | | |")
        timed.append({"params": size, "path": TORCH_PATH,
                      "seconds": torch_s, "bytes_per_param": TORCH_BYTES})
      continue
    params = make_params(size, dtype)
    grads = jax.tree_util.tree_map(lambda p: (p * 1024).astype(dtype), params)
    loss_scale = jmp_lab.StaticLossScale(1024.0)
    tree = jmp_lab.fused_adamw(1e-4, policy=policy, loss_scale=loss_scale)
    fused = jmp_lab.fused_adamw(1e-4, policy=policy, loss_scale=loss_scale,
                                layout="flat")
    unfused = jmp_lab.mixed_precision(optax.adamw(1e-4), policy=policy,
                                      loss_scale=loss_scale)
    copy_s = time_copy(size, **timing)
    copy_bw = 8 * size / copy_s
    rows = [
        ("fused tree (new params)",
         time_new_params(tree, params, grads, **timing), FUSED_BYTES),
        ("fused tree (updates + apply_updates)",
         time_optimizer(tree, params, grads, **timing), FUSED_BYTES),
        ("fused flat (tree grads)",
         time_optimizer(fused, params, grads, **timing), FUSED_BYTES),
        ("fused flat (flat params)",
         time_flat_step(fused, params, grads, **timing), FUSED_BYTES),
        ("fused flat kernel alone (no flag pass)",
         time_flat_kernel(fused, params, grads, **timing), FUSED_BYTES - 2),
        ("unfused mixed_precision(adamw)",
         time_optimizer(unfused, params, grads, **timing), UNFUSED_BYTES_MIN),
    ]
    torch_s = (time_torch(size, **timing) if on_gpu and not args.no_torch
               else None)
    if torch_s is not None:
      rows.append((TORCH_PATH, torch_s, TORCH_BYTES))
    rows.append(("copy (x + 1, fp32)", copy_s, 8))
    reference = jmp_lab.fused_adamw(1e-4, policy=policy, loss_scale=loss_scale,
                                    backend="reference", layout="flat")
    state = reference.init(params)
    xla_bytes = {
        "fused, tree grads": xla_bytes_per_param(reference, params, grads),
        "fused, flat params": xla_bytes_per_param(
            reference, jmp_lab.flat_params(state, params),
            jmp_lab.flat_params(state, grads), state),
        "unfused": xla_bytes_per_param(unfused, params, grads),
    }
    fused_s = rows[0][1]
    timed += [{"params": size, "path": name, "seconds": seconds,
               "bytes_per_param": per_param} for name, seconds, per_param in rows]
    for name, seconds, per_param in rows:
      rate = per_param * size / seconds
      print(f"| {size:,} | {name} | {seconds * 1e3:.3f} | {per_param} | "
            f"{rate / 1e9:.1f} | {rate / copy_bw:.2f} | {seconds / fused_s:.2f} |")
    print(f"| {size:,} | XLA cost model, bytes accessed per param (reference "
          f"backend): " + "; ".join(f"{k} {v:.0f}" for k, v in xla_bytes.items())
          + " | | | | | |")
    sys.stdout.flush()
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": device.device_kind, "jax": jax.__version__,
                 "rows": timed}, f, indent=1)


if __name__ == "__main__":
  main()
