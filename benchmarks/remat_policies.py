"""What jax's remat policies save under the block-scaled keys, against bf16.

A pre-LN MLP block (LayerNorm, Dense up 4x, GELU, Dense down, residual)
four times under ``nn.remat(policy=...)`` in a model run by
``jmp_lab.linen.with_policy``, its gradient step compiled for a B200 without
one (``jmp_lab.diagnostics.compiled_report``). For each remat policy and
config: the GEMMs the compiled step runs, and its temporaries as a ratio to
bf16's under the same policy. A policy that saves dots
(``dots_with_no_batch_dims_saveable``, MaxText's ``"minimal"``) should run
no forward GEMM again in the backward: as many GEMMs as without remat.
Every figure is a model of a compiled program, not a measurement::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/remat_policies.py
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import jmp_lab
from jmp_lab.diagnostics import compiled_report

POLICIES = {
    "no remat": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names(mlp_up)":
        jax.checkpoint_policies.save_only_these_names("mlp_up"),
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4 * x.shape[-1], name="up")(nn.LayerNorm()(x))
    h = checkpoint_name(h, "mlp_up")
    return x + nn.Dense(x.shape[-1], name="down")(nn.gelu(h))


class Model(nn.Module):
  remat_policy: str
  depth: int

  @nn.compact
  def __call__(self, x):
    policy = POLICIES[self.remat_policy]
    block = Block if policy is None else nn.remat(Block, policy=policy)
    for i in range(self.depth):
      x = block(name=f"block_{i}")(x)
    return x


def step_report(remat_policy: str, policy: str, x, depth: int):
  model = jmp_lab.linen.with_policy(Model(remat_policy, depth), policy)
  params = jax.eval_shape(model.init, jax.random.key(0), x)

  def step(params, x):
    return jax.grad(lambda p: model.apply(p, x).astype(jnp.float32).sum())(
        params)

  return compiled_report(step, params, x, target="b200")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="mixed_mxfp8,mixed_nvfp4",
                      help="block-scaled policies, each against "
                           "mixed_bfloat16")
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--tokens", type=int, default=4096)
  args = parser.parse_args()
  if args.tokens < 512 or args.tokens % 512:
    parser.error(f"--tokens must be a positive multiple of 512 (sequences "
                 f"of 512), got {args.tokens}")
  x = jnp.ones((args.tokens // 512, 512, args.width), jnp.float32)
  configs = args.configs.split(",")
  print(f"| remat policy | bf16 GEMMs | "
        + " | ".join(f"{c} GEMMs | {c} temp vs bf16" for c in configs) + " |")
  print("|---|---|" + "---|---|" * len(configs))
  for name in POLICIES:
    bf16 = step_report(name, "mixed_bfloat16", x, args.depth)
    cells = []
    for config in configs:
      report = step_report(name, config, x, args.depth)
      cells += [str(sum(g.times for g in report.gemms)),
                f"{report.memory['temp'] / bf16.memory['temp']:.3f}x"]
    print(f"| {name} | {sum(g.times for g in bf16.gemms)} | "
          + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
