"""Diagnostics: see what mixed precision is doing to your model.

One module per question, each answering with a dataclass whose ``table()``
(and ``str()``) prints it:

* :mod:`.histogram` -- :func:`gradient_histogram`: ``|g|`` in log2 buckets
  against the fp16 and bf16 ranges, and the loss scales that keep them all;
  :func:`plot_gradient_histogram` draws it;
* :mod:`.audit` -- :func:`audit_step`: every matmul and convolution of a
  traced step, their dtypes, shapes, FLOP shares and the casts;
* :mod:`.memory` -- :func:`memory_row` / :func:`memory_report`: compiled
  memory, state bytes per parameter and activation bytes, per policy;
  :func:`compiled_memory` reads XLA's memory analysis;
* :mod:`.recorder` -- :class:`TrainingRecorder`: the loss, loss scale and
  skipped steps, recorded without synchronising inside a step;
* :mod:`.compiled` -- :func:`compiled_report`: the step compiled for an H100
  or H200 on a machine without a GPU: memory, bytes, kernels, GEMM dtypes,
  collectives, Pallas registers and a roofline model (:mod:`.hlo` reads the
  compiled module).
"""

from jmp_lab.diagnostics.audit import AuditReport, MatmulRecord, audit_step
from jmp_lab.diagnostics.compiled import (CollectiveRecord, CompiledReport,
                                          GemmRecord, GpuTarget, KernelRecord,
                                          PallasKernel,
                                          ThunkRecord, compile_for_gpu, compiled_report,
                                          gpu_mesh, gpu_target)
from jmp_lab.diagnostics.histogram import (FloatRange,
                                           GradientHistogram,
                                           gradient_histogram,
                                           plot_gradient_histogram)
from jmp_lab.diagnostics.memory import (MemoryReport, MemoryRow,
                                        activation_bytes, compiled_memory,
                                        memory_report, memory_row)
from jmp_lab.diagnostics.recorder import TrainingRecorder

from jmp_lab.diagnostics import histogram as _histogram

#: The range of float16 (:class:`FloatRange`).
FP16 = _histogram.FP16
#: The range of bfloat16 (:class:`FloatRange`).
BF16 = _histogram.BF16

__all__ = [
    "AuditReport",
    "BF16",
    "CollectiveRecord",
    "CompiledReport",
    "FP16",
    "FloatRange",
    "GemmRecord",
    "GpuTarget",
    "GradientHistogram",
    "KernelRecord",
    "MatmulRecord",
    "MemoryReport",
    "MemoryRow",
    "PallasKernel",
    "ThunkRecord",
    "TrainingRecorder",
    "activation_bytes",
    "audit_step",
    "compile_for_gpu",
    "compiled_memory",
    "compiled_report",
    "gpu_mesh",
    "gpu_target",
    "gradient_histogram",
    "memory_report",
    "memory_row",
    "plot_gradient_histogram",
]
