"""GPT train steps compiled for a B200 without one: bf16 against MXFP8 and
NVFP4 (``jmp_lab.block_scaled``), from the compiled modules.

For each model size and config: the GEMMs the module runs, how many are
cuDNN's block-scaled GEMM (``__cudnn$blockScaledDot``), their share of the
GEMM FLOPs, the per-device memory, and the roofline step time
(``CompiledReport.roofline_seconds``: bytes over the B200's bandwidth plus
each GEMM's FLOPs over its math's data-sheet peak) as a ratio to bf16's,
and the overlapped roofline (each GEMM kernel the larger of its bytes' and
its math's time, not their sum) beside it. ``--per-layer`` also gives each
layer's quantize kernels' time (their bytes, under jmp_lab's quantize scope;
printed by site too: the quantizing layer, the pass, jmp_lab's kernel or
XLA's passes) and the step were quantizing free ("free q.": those bytes removed,
everything else as compiled). A quantization fused into its producers (a
norm or an activation writing the 8- or 4-bit copies in place of its 16-bit
output, as Transformer Engine's fused kernels do) comes near that figure; a
quantize kernel of its own, which must read its 16-bit input, stays above
it.
Every figure is a model of a compiled program, not a measurement. Spills
are allowed: in NVFP4 steps XLA merges several quantizations into one
multi-output kernel that spills 40 bytes on sm_100a (XLA's fusion choice;
jmp_lab's own Pallas kernels compile for sm_100a without spills)::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/block_scaled_compile.py \\
      --size gpt2-small
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/block_scaled_compile.py \\
      --size 1.3b --lean --per-layer

``--four-over-six`` adds each NVFP4 config under Four Over Six.
``--forward`` compiles the model's forward alone (evaluation: ``apply``, no
gradient) under each policy instead of the train step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_lab
from benchmarks import train_step as ts
from benchmarks.fp8_breakdown import SIZES

CONFIGS = [ts.Config("bf16", "mixed_bfloat16", "none"),
           *ts.BLOCK_SCALED_CONFIGS]
# The lean step (fused attention, the loss over vocabulary blocks, whose
# head GEMMs stay bf16 inside the loss kernel): the 1.3B-class comparison.
LEAN_CONFIGS = [ts.Config("bf16-lean", "mixed_bfloat16", "none", lean=True),
                *ts.BLOCK_SCALED_LEAN_CONFIGS]


class NnxBlock(nnx.Module):
  """``train_step.Block`` in NNX: pre-LayerNorm attention and a 4x GELU
  MLP, every projection a Linear/LinearGeneral."""

  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, width, decode=False,
                                            rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, rngs=rngs)
    self.fc = nnx.Linear(width, 4 * width, rngs=rngs)
    self.proj = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x, mask):
    h = self.ln1(x)
    x = x + self.attention(h, h, h, mask=mask)
    return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


class NnxGPT(nnx.Module):
  """``train_step.GPT`` in NNX (learned positions, an unbiased head)."""

  def __init__(self, size: ts.ModelSize, rngs: nnx.Rngs):
    self.tokens = nnx.Embed(size.vocab, size.width, rngs=rngs)
    self.positions = nnx.Embed(size.seq_len, size.width, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(size.width, size.heads, rngs)
                            for _ in range(size.layers)]) if hasattr(
        nnx, "List") else [NnxBlock(size.width, size.heads, rngs)
                           for _ in range(size.layers)]
    self.ln = nnx.LayerNorm(size.width, rngs=rngs)
    self.head = nnx.Linear(size.width, size.vocab, use_bias=False,
                           rngs=rngs)

  def __call__(self, tokens):
    x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln(x))


def gradient_step_report(front_end: str, policy: str, size: ts.ModelSize):
  """The loss's gradient (cross-entropy of the next token) of GPT-2 at
  ``size`` under ``policy``, on ``"linen"`` or ``"nnx"``, compiled for a
  B200 (shapes only; spills allowed, see the module doc): the GEMMs of a
  step without its optimizer update."""
  from jmp_lab.diagnostics import compiled_report  # pylint: disable=import-outside-toplevel
  batch = jax.ShapeDtypeStruct((size.batch, size.seq_len + 1), jnp.int32)

  def loss_of(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch[:, 1:]).mean()

  if front_end == "linen":
    model = jmp_lab.linen.with_policy(ts.GPT(size), policy)
    params = jax.eval_shape(model.init, jax.random.key(0),
                            jnp.zeros((1, size.seq_len), jnp.int32))
    step = jax.grad(lambda p, b: loss_of(model.apply(p, b[:, :-1]), b))
    return compiled_report(step, params, batch, target="b200",
                           fail_on_spill=False)
  model = nnx.eval_shape(lambda: jmp_lab.nnx.with_policy(
      NnxGPT(size, nnx.Rngs(0)), policy))
  graph, state = nnx.split(model)
  step = jax.grad(lambda s, b: loss_of(nnx.merge(graph, s)(b[:, :-1]), b))
  return compiled_report(step, state, batch, target="b200",
                         fail_on_spill=False)


def forward_row(policy: str, size: ts.ModelSize) -> dict:
  """GPT-2 at ``size``: its forward alone (``model.apply`` on a batch of
  tokens, no gradient) under ``policy``, compiled for a B200."""
  from jmp_lab.diagnostics import compiled_report  # pylint: disable=import-outside-toplevel
  model = jmp_lab.linen.with_policy(ts.GPT(size), policy)
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, size.seq_len), jnp.int32))
  tokens = jax.ShapeDtypeStruct((size.batch, size.seq_len), jnp.int32)
  report = compiled_report(model.apply, params, tokens, target="b200",
                           fail_on_spill=False)
  roof = report.roofline_seconds()
  return {
      "policy": policy,
      "block_scaled_gemms": sum(g.times for g in report.block_scaled_gemms),
      "pallas_kernels": len(report.pallas_kernels),
      "temp_gib": report.memory.get("temp", 0) / 2**30,
      "roofline_ms": roof["total"] * 1e3,
      "memory_ms": roof["memory"] * 1e3,
      "gemm_ms": roof["gemm"] * 1e3,
  }


def forward_table(rows: list[dict]) -> str:
  lines = ["| forward | block-scaled GEMMs | Pallas kernels | temp GiB | "
           "roofline ms (memory + GEMM) | vs first |", "|---" * 6 + "|"]
  for r in rows:
    lines.append(
        f"| {r['policy']} | {r['block_scaled_gemms']} | {r['pallas_kernels']}"
        f" | {r['temp_gib']:.2f} | {r['roofline_ms']:.3f} "
        f"({r['memory_ms']:.3f} + {r['gemm_ms']:.3f}) | "
        f"{r['roofline_ms'] / rows[0]['roofline_ms']:.3f}x |")
  return "\n".join(lines)


FOUR_OVER_SIX = "+4/6"


def with_four_over_six(configs) -> list:
  """``configs`` and, after them, each NVFP4 one under Four Over Six."""
  return [*configs, *(dataclasses.replace(c, name=c.name + FOUR_OVER_SIX)
                      for c in configs if c.policy == "mixed_nvfp4")]


def compiled_report_of(config: ts.Config, size: ts.ModelSize):
  """``config``'s step compiled for a B200 (spills allowed, see the module
  doc), traced under Four Over Six where its name says so."""
  recipe = (jmp_lab.block_scaled.nvfp4_recipe(four_over_six=True)
            if config.name.endswith(FOUR_OVER_SIX)
            else contextlib.nullcontext())
  with recipe:
    return ts.compiled_step_report(config, size, "b200", fail_on_spill=False)


def row(config: ts.Config, size: ts.ModelSize) -> dict:
  report = compiled_report_of(config, size)
  roof = report.roofline_seconds()
  return {
      "config": config.name,
      "gemms": sum(g.times for g in report.gemms),
      "block_scaled_gemms": sum(g.times for g in report.block_scaled_gemms),
      "other_gemms": sorted({f"{g.kind} {g.operands}" for g in report.gemms
                             if g.block_scaled is None}),
      "block_scaled_flop_share": report.block_scaled_flop_share(),
      "argument_gib": report.memory.get("argument", 0) / 2**30,
      "temp_gib": report.memory.get("temp", 0) / 2**30,
      "roofline_ms": roof["total"] * 1e3,
      "overlapped_ms": roof["overlapped"] * 1e3,
      "gemm_ms": roof["gemm"] * 1e3,
      "memory_ms": roof["memory"] * 1e3,
  }


QUANTIZE_SCOPE = "jmp_lab_block_quantize"


def roofline_and_quantization(report) -> dict[str, float]:
  """``report``'s roofline seconds, and ``"quantize"``: the seconds of its
  quantize kernels' bytes (every kernel under jmp_lab's quantize scope) at
  the target's bandwidth."""
  return {**report.roofline_seconds(),
          "quantize": report.scope(QUANTIZE_SCOPE)["io_bytes"]
                      / report.target.memory_bandwidth}


def quantize_sites(report) -> collections.Counter:
  """The bytes of ``report``'s quantize kernels by site: ``(layer, pass,
  kind)``, the layer the module that quantizes (``Dense_0``, ``query``...),
  the pass ``"forward"`` or ``"backward"`` (its name stack holds a
  ``transpose``), the kind ``"kernel"`` (jmp_lab's Pallas quantize kernels:
  activations and output gradients) or ``"XLA"`` (XLA's fusions: the
  weights)."""
  sites = collections.Counter()
  for k in report.kernel_records:
    path = k.op_name.split("/")
    if QUANTIZE_SCOPE not in path:
      continue
    above = path[:path.index(QUANTIZE_SCOPE)]
    layer = next((p for p in reversed(above) if not p.startswith("jmp_lab")),
                 "?")
    backward = any(p.startswith("transpose(") for p in path)
    sites[(layer, "backward" if backward else "forward",
           "kernel" if k.opcode == "custom-call" else "XLA")] += (
               k.io_bytes * k.times)
  return sites


_NOT_A_LAYER = ("jmp_lab", "cond", "branch_", "jvp(", "transpose(", "jit(",
                "remat", "checkpoint")


def kernel_sites(report) -> collections.Counter:
  """The kernel-boundary bytes of every kernel of ``report`` by site:
  ``(pass, layer, op)``, the layer the nearest module of the op's name
  stack (``query``, ``Dense_0``, ``LayerNorm_1``, ``jmp_lab_update`` for the
  optimizer), the op the last name in it (``dot_general``, ``add``,
  ``pallas_call``...). The sites of a model's layers repeat, so the
  difference between two depths is one layer's kernels."""
  sites = collections.Counter()
  for k in report.kernel_records:
    path = [p for p in k.op_name.split("/") if p]
    op = path[-1] if path else k.opcode
    if QUANTIZE_SCOPE in path:  # a quantization: of the layer above it
      op = f"{QUANTIZE_SCOPE}/{op}"
      path = path[:path.index(QUANTIZE_SCOPE) + 1]
    layer = next((p for p in reversed(path[:-1])
                  if p == "jmp_lab_update" or not p.startswith(_NOT_A_LAYER)),
                 "?")
    backward = any(p.startswith("transpose(") for p in path)
    sites[("backward" if backward else "forward", layer,
           f"{k.opcode} {op}")] += k.io_bytes * k.times
  return sites


def _layer_difference(count, one, two) -> dict:
  sites = count(two)
  sites.subtract(count(one))
  return {" ".join(site): b / 1e9 for site, b in sites.items() if b}


def per_layer(configs, size: ts.ModelSize) -> dict:
  """Each config's roofline at 1 and 2 layers, its per-layer cost (the
  difference) and that extrapolated to ``size.layers``, printed; and each
  layer's quantization bytes by site (:func:`quantize_sites`) and all its
  kernels' bytes by site (:func:`kernel_sites`)."""
  out = {}
  for config in configs:
    one, two = (compiled_report_of(config, dataclasses.replace(size, layers=n))
                for n in (1, 2))
    quantize_gb = _layer_difference(quantize_sites, one, two)
    kernels_gb = _layer_difference(kernel_sites, one, two)
    one, two = roofline_and_quantization(one), roofline_and_quantization(two)
    layer = {k: two[k] - one[k] for k in one}
    whole = {k: one[k] + (size.layers - 1) * layer[k] for k in one}
    out[config.name] = {"per_layer_ms": {k: v * 1e3 for k, v in layer.items()},
                        "extrapolated_ms": {k: v * 1e3
                                            for k, v in whole.items()},
                        "quantize_sites_gb": quantize_gb,
                        "kernel_sites_gb": kernels_gb}
  first = out[configs[0].name]
  base = first["extrapolated_ms"]["total"]
  base_overlapped = first["extrapolated_ms"]["overlapped"]
  print(f"{'config':<20} {'per layer ms (memory + GEMM)':>30} "
        f"{'quantize':>9} {f'{size.layers} layers ms':>14} {'vs first':>9} "
        f"{'free q.':>8} {'overlapped ms':>14} {'vs first':>9} "
        f"{'free q.':>8}")
  for name, r in out.items():
    layer, whole = r["per_layer_ms"], r["extrapolated_ms"]
    r["floor_ms"] = whole["total"] - size.layers * layer["quantize"]
    r["overlapped_floor_ms"] = (whole["overlapped"]
                                - size.layers * layer["quantize"])
    print(f"{name:<20} {layer['total']:>10.3f} ({layer['memory']:.3f} + "
          f"{layer['gemm']:.3f}) {layer['quantize']:>9.3f} "
          f"{whole['total']:>14.2f} "
          f"{whole['total'] / base:>8.3f}x {r['floor_ms'] / base:>7.3f}x "
          f"{whole['overlapped']:>14.2f} "
          f"{whole['overlapped'] / base_overlapped:>8.3f}x "
          f"{r['overlapped_floor_ms'] / base_overlapped:>7.3f}x", flush=True)
  for name, r in out.items():
    if r["quantize_sites_gb"]:
      print(f"{name}: quantization a layer by site (GB): " + ", ".join(
          f"{site} {gb:.3f}" for site, gb in sorted(
              r["quantize_sites_gb"].items())), flush=True)
  print(kernel_table(out), flush=True)
  return out


def kernel_table(out: dict, at_least_gb: float = 0.01) -> str:
  """Each layer's kernel-boundary GB by site (:func:`kernel_sites`), one
  column a config and the first config's beside each other's difference
  from it; the sites where some config moves at least ``at_least_gb``."""
  names = list(out)
  by_site = {name: out[name]["kernel_sites_gb"] for name in names}
  sites = sorted({s for gb in by_site.values() for s, v in gb.items()
                  if abs(v) >= at_least_gb})
  first = by_site[names[0]]
  lines = ["kernel GB a layer, by site (pass layer kernel-kind op): "
           + " | ".join(names[:1] + [f"{n} (- {names[0]})"
                                     for n in names[1:]])]
  for site in sorted(sites, key=lambda s: -max(abs(g.get(s, 0))
                                               for g in by_site.values())):
    base = first.get(site, 0.0)
    cells = [f"{base:7.3f}"] + [
        f"{by_site[n].get(site, 0.0):7.3f} ({by_site[n].get(site, 0.0) - base:+.3f})"
        for n in names[1:]]
    lines.append(f"  {site:<58} " + "  ".join(cells))
  totals = [sum(by_site[n].values()) for n in names]
  lines.append(f"  {'all kernels':<58} " + "  ".join(
      [f"{totals[0]:7.3f}"] + [f"{t:7.3f} ({t - totals[0]:+.3f})"
                               for t in totals[1:]]))
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  base = rows[0]["roofline_ms"]
  lines = [f"{'config':<12} {'GEMMs':>6} {'block-scaled':>13} {'FLOP %':>7} "
           f"{'args GiB':>9} {'temp GiB':>9} {'roofline ms':>12} "
           f"{'GEMM ms':>8} {'memory ms':>10} {'vs bf16':>8} "
           f"{'overlapped':>11} {'vs bf16':>8}"]
  for r in rows:
    lines.append(
        f"{r['config']:<12} {r['gemms']:>6} {r['block_scaled_gemms']:>13} "
        f"{100 * r['block_scaled_flop_share']:>6.1f}% "
        f"{r['argument_gib']:>9.2f} {r['temp_gib']:>9.2f} "
        f"{r['roofline_ms']:>12.2f} {r['gemm_ms']:>8.2f} "
        f"{r['memory_ms']:>10.2f} {r['roofline_ms'] / base:>7.3f}x "
        f"{r['overlapped_ms']:>11.2f} "
        f"{r['overlapped_ms'] / rows[0]['overlapped_ms']:>7.3f}x")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", action="append", choices=sorted(SIZES))
  parser.add_argument("--lean", action="store_true",
                      help="the lean step's configs (bf16-lean first)")
  parser.add_argument("--per-layer", action="store_true",
                      help="compile 1 and 2 layers of the size and give the "
                           "roofline per layer and extrapolated to its "
                           "layers (quicker than the whole model)")
  parser.add_argument("--nnx", action="store_true",
                      help="also: the loss gradient on NNX and linen, "
                           "every GEMM listed")
  parser.add_argument("--four-over-six", action="store_true",
                      help="also each NVFP4 config under Four Over Six "
                           "(nvfp4_recipe(four_over_six=True)), named +4/6")
  parser.add_argument("--forward", action="store_true",
                      help="the forward alone (apply, no gradient) under "
                           "mixed_bfloat16, mixed_mxfp8 and mixed_nvfp4")
  parser.add_argument("--configs", default=None,
                      help="','-separated config names to run (the first of "
                           "the list is the baseline)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  configs = LEAN_CONFIGS if args.lean else CONFIGS
  if args.four_over_six:
    configs = with_four_over_six(configs)
  if args.configs:
    wanted = args.configs.split(",")
    unknown = set(wanted) - {c.name for c in configs}
    if unknown:
      parser.error(f"--configs: unknown {sorted(unknown)}; accepted: "
                   f"{', '.join(c.name for c in configs)}")
    by_name = {c.name: c for c in configs}
    configs = [by_name[name] for name in wanted]
  results = {}
  for name in args.size or ["gpt2-small"]:
    if args.forward:
      rows = [forward_row(policy, SIZES[name]) for policy in
              ("mixed_bfloat16", "mixed_mxfp8", "mixed_nvfp4")]
      results[name] = rows
      print(f"{name}, the forward compiled for 1 x B200 (models)")
      print(forward_table(rows), flush=True)
      continue
    if args.per_layer:
      results[name] = per_layer(configs, SIZES[name])
      continue
    rows = [row(config, SIZES[name]) for config in configs]
    results[name] = rows
    print(f"{name}, compiled for 1 x B200 (models, not measurements)")
    print(table(rows), flush=True)
    if args.nnx:
      for front_end in ("linen", "nnx"):
        for policy in ("mixed_mxfp8", "mixed_nvfp4"):
          report = gradient_step_report(front_end, policy, SIZES[name])
          print(f"{front_end} {policy} gradient: "
                f"{len(report.block_scaled_gemms)} block-scaled GEMMs of "
                f"{len(report.gemms)}, "
                f"{100 * report.block_scaled_flop_share():.1f}% of the GEMM "
                f"FLOPs; the others: " + ", ".join(sorted(
                    f"{g.kind} {g.operands} {g.lhs.dims}x{g.rhs.dims}"
                    for g in report.gemms if g.block_scaled is None)),
                flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
