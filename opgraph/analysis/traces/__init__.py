"""Measured profiles: PyTorch profiler (Kineto) traces, read, classified and set beside the
roofline.

- `read` (`iter_kernels`, `read_trace`): a trace file -> its GPU kernels, read incrementally
  (`jsonstream`) from a capped byte stream (`source`);
- `rules` (`KERNEL_RULES`, `classify`, `load_rules`): a kernel's name -> its category, in the one
  vocabulary of `opgraph.core.categories`;
- `intervals` (`breakdown`, `format_breakdown`): time per category, busy, idle and span;
- `compare`: a breakdown beside a roofline `Profile`.

Example::

    from opgraph.analysis.traces import breakdown, iter_kernels
    print(format_breakdown(breakdown(iter_kernels("step.json.gz"))))
"""

from ...core.limits import MAX_TRACE_BYTES
from .intervals import Breakdown, CategoryTime, breakdown, format_breakdown
from .read import Kernel, iter_kernels, read_trace
from .rules import KERNEL_RULES, classify, load_rules

__all__ = [
    "KERNEL_RULES",
    "MAX_TRACE_BYTES",
    "Breakdown",
    "CategoryTime",
    "Kernel",
    "breakdown",
    "classify",
    "format_breakdown",
    "iter_kernels",
    "load_rules",
    "read_trace",
]
