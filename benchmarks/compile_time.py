"""How long a GPT-2 step takes to compile for an H100 without one, with XLA's
fusion autotuner on (XLA's default) and off (what ``compile_for_gpu`` does),
and whether the two programs are the same.

Without a device the autotuner cannot time anything, so it keeps each
fusion's default config; XLA still compiles every candidate first. The
table gives each config's seconds both ways (the median of ``--repeats``
compiles, the two settings alternated so that both see the same machine),
their ratio, and whether the two programs have the same kernels (name,
opcode, bytes), cost-model bytes and memory::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/compile_time.py \\
      --configs bf16-o2,bf16-o2+fused --layers 12 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import jmp_lab
from benchmarks import train_step as ts

_AUTOTUNER = "xla_gpu_experimental_enable_fusion_autotuner"


def compile_with_autotuner(config: ts.Config, size: ts.ModelSize,
                           autotuner: bool):
  """The step's report and compile seconds, with XLA's fusion autotuner
  ``autotuner`` (compile_for_gpu's option replaced for this compile)."""
  real_compile = jax.stages.Lowered.compile

  def compile_(self, compiler_options=None, **kwargs):
    return real_compile(self, compiler_options={**(compiler_options or {}),
                                                _AUTOTUNER: autotuner},
                        **kwargs)

  jax.stages.Lowered.compile = compile_
  try:
    start = time.perf_counter()
    report = ts.compiled_step_report(config, size, "h100")
    return report, time.perf_counter() - start
  finally:
    jax.stages.Lowered.compile = real_compile


def same_program(a, b) -> bool:
  kernels = lambda r: sorted((k.name, k.opcode, k.io_bytes, k.times)  # noqa: E731
                             for k in r.kernel_records)
  return (kernels(a) == kernels(b) and a.bytes_accessed == b.bytes_accessed
          and a.memory == b.memory)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="bf16-o2",
                      help="comma-separated train_step config names")
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  names = args.configs.split(",")
  known = {c.name: c for c in ts.ALL_CONFIGS}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"--configs: unknown {unknown}; known: {sorted(known)}")
  if args.repeats < 1 or args.layers < 1:
    raise ValueError(f"--repeats and --layers must be >= 1, got "
                     f"{args.repeats} and {args.layers}")
  size = ts.ModelSize(layers=args.layers)
  print(f"jax {jax.__version__}, jmp_lab {jmp_lab.__version__}, GPT-2-small "
        f"with {args.layers} layers, H100 target, median of {args.repeats}")
  print(f"{'config':<24}{'autotuner on s':>16}{'off s':>10}{'off/on':>9}"
        f"  same program")
  for name in names:
    seconds = {True: [], False: []}
    reports = {}
    for repeat in range(args.repeats):
      for autotuner in ((True, False) if repeat % 2 == 0 else (False, True)):
        reports[autotuner], took = compile_with_autotuner(
            known[name], size, autotuner)
        seconds[autotuner].append(took)
    on, off = (statistics.median(seconds[k]) for k in (True, False))
    print(f"{name:<24}{on:>16.1f}{off:>10.1f}{off / on:>9.2f}  "
          f"{same_program(reports[True], reports[False])}")


if __name__ == "__main__":
  main()
