"""Interval arithmetic over a trace's kernels: time per category, busy time, idle time and span.

Busy time is the length of the union of the kernels' intervals over every stream and device (two
kernels running at once count once); idle time is the span, from the first kernel's start to the
last kernel's end, minus busy time. `breakdown` takes any iterable of kernels and keeps only two
floats per kernel (its start and end), so a trace read with `iter_kernels` is never held whole.

Invariants: the categories' times add up to ``kernel_time_s``; ``busy <= min(kernel time, span)``;
``idle = span - busy``; every figure is finite (times are checked when read).
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable

import attrs
import numpy as np

from .read import Kernel, gc_paused
from .rules import KERNEL_RULES, compile_rules, first_match

# Distinct names remembered with their category (a step has hundreds; a hostile file, any number).
_CATEGORY_CACHE = 65536


@attrs.frozen
class CategoryTime:
    """GPU time spent in one category of kernels; ``share`` is the fraction of all kernel time."""

    name: str
    time_s: float
    share: float
    kernels: int


@attrs.frozen
class Breakdown:
    """Where GPU time went: per category, and busy versus idle over the traced span.

    ``kernel_time_s`` adds up kernel durations, so kernels that overlap on different streams are
    counted twice; ``busy_time_s`` is the time at least one kernel was running;
    ``idle_time_s = span_s - busy_time_s``.
    """

    kernel_time_s: float
    busy_time_s: float
    idle_time_s: float
    span_s: float
    kernels: int
    categories: list[CategoryTime]

    def to_json(self) -> dict:
        """The breakdown as plain JSON-ready data.

        >>> breakdown([Kernel("Memset (Device)", 0.0, 2.0, 7, 0)]).to_json()["categories"]
        [{'name': 'memory', 'time_s': 2e-06, 'share': 1.0, 'kernels': 1}]
        """
        return {
            "kernel_time_s": self.kernel_time_s,
            "busy_time_s": self.busy_time_s,
            "idle_time_s": self.idle_time_s,
            "span_s": self.span_s,
            "kernels": self.kernels,
            "categories": [attrs.asdict(c) for c in self.categories],
        }


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by intervals [start, end), overlaps counted once.

    Sort by start; a new run of overlapping intervals begins where a start lies beyond every end
    before it; each run covers from its first start to the largest end in it.

    >>> union_length(np.array([0.0, 5.0, 20.0]), np.array([10.0, 12.0, 25.0]))
    17.0
    """
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the furthest end among the first i + 1 intervals
    new_run = np.empty(len(starts), dtype=bool)
    new_run[0] = True
    new_run[1:] = starts[1:] > reach[:-1]
    first = np.flatnonzero(new_run)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return float(np.sum(reach[last] - starts[first]))


def breakdown(kernels: Iterable[Kernel], rules: Iterable = KERNEL_RULES) -> Breakdown:
    """Time per kernel category, plus busy and idle GPU time, in seconds.

    Busy time is the union of all kernel intervals across streams and devices; idle time is the
    rest of the span from the first kernel's start to the last kernel's end. Each distinct kernel
    name is classified once. An empty iterable gives an all-zero breakdown with no categories.

    >>> b = breakdown([Kernel("ampere_sgemm_128x64_nn", 0.0, 10.0, 7, 0),
    ...                Kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 15.0, 5.0, 20, 0)])
    >>> b.busy_time_s, b.idle_time_s, [c.name for c in b.categories]
    (1.5e-05, 5e-06, ['matmul', 'communication'])
    """
    compiled = compile_rules(rules)
    kernels = iter(kernels)
    first = next(kernels, None)
    if first is None:
        return Breakdown(0.0, 0.0, 0.0, 0.0, 0, [])
    # Measure from the first kernel read: trace timestamps are ~1e15 us, where a float's step is
    # ~0.1 us, so "ts + dur" would round away part of a short kernel; offsets are exact.
    origin = first.ts_us
    # Two floats and a category number per kernel; each distinct name is classified once.
    starts, durations, classes = array("d"), array("d"), array("H")
    categories: list[str] = []  # category number -> name
    number_of: dict[str, int] = {}  # kernel name -> its category's number
    add_start, add_duration, add_class = starts.append, durations.append, classes.append
    with gc_paused():
        for name, ts, dur, _, _ in itertools.chain((first,), kernels):
            number = number_of.get(name)
            if number is None:
                number = _number(first_match(name, compiled), categories)
                if len(number_of) >= _CATEGORY_CACHE:
                    number_of.clear()
                number_of[name] = number
            add_start(ts - origin)
            add_duration(dur)
            add_class(number)

    start_us, dur_us = np.frombuffer(starts), np.frombuffer(durations)
    end_us = start_us + dur_us
    numbers = np.frombuffer(classes, dtype=np.uint16)
    counts = np.bincount(numbers, minlength=len(categories))
    time_us = [math.fsum(dur_us[numbers == n]) for n in range(len(categories))]
    kernel_us = math.fsum(time_us)
    span_us = float(end_us.max() - start_us.min())
    busy_us = union_length(start_us, end_us)
    rows = [
        CategoryTime(
            name=category,
            time_s=time_us[n] / 1e6,
            share=time_us[n] / kernel_us if kernel_us > 0 else 0.0,
            kernels=int(counts[n]),
        )
        for n, category in enumerate(categories)
    ]
    rows.sort(key=_by_time_then_name)
    return Breakdown(
        kernel_time_s=kernel_us / 1e6,
        busy_time_s=busy_us / 1e6,
        idle_time_s=(span_us - busy_us) / 1e6,
        span_s=span_us / 1e6,
        kernels=len(starts),
        categories=rows,
    )


def _number(category: str, categories: list[str]) -> int:
    """The category's index in `categories`, appending it the first time it is seen."""
    if category not in categories:
        categories.append(category)
    return categories.index(category)


def _by_time_then_name(category: CategoryTime) -> tuple[float, str]:
    return (-category.time_s, category.name)


def format_breakdown(b: Breakdown) -> str:
    """A fixed-width text table of the breakdown, for a terminal.

    >>> print(format_breakdown(breakdown([Kernel("ampere_sgemm_128x64_nn", 0.0, 10.0, 7, 0)])))
    category     time (ms)   share  kernels
    matmul           0.010  100.0%        1
    <BLANKLINE>
    kernel time      0.010 ms  sum of the durations of 1 kernel
    busy             0.010 ms  at least one kernel running
    idle             0.000 ms  0.0% of span
    span             0.010 ms  first kernel start to last kernel end
    """
    totals = (b.kernel_time_s, b.busy_time_s, b.idle_time_s, b.span_s)
    numbers = [f"{c.time_s * 1e3:.3f}" for c in b.categories] + [f"{t * 1e3:.3f}" for t in totals]
    name_width = max([len("kernel time")] + [len(c.name) for c in b.categories])
    time_width = max([len("time (ms)")] + [len(n) for n in numbers])
    lines = [
        f"{'category':<{name_width}}  {'time (ms)':>{time_width}}  {'share':>6}  {'kernels':>7}"
    ]
    for c in b.categories:
        time_ms = f"{c.time_s * 1e3:.3f}"
        lines.append(
            f"{c.name:<{name_width}}  {time_ms:>{time_width}}  {c.share:>6.1%}  {c.kernels:>7,}"
        )
    idle_share = b.idle_time_s / b.span_s if b.span_s > 0 else 0.0
    kernel_word = "kernel" if b.kernels == 1 else "kernels"
    notes = (
        ("kernel time", b.kernel_time_s, f"sum of the durations of {b.kernels:,} {kernel_word}"),
        ("busy", b.busy_time_s, "at least one kernel running"),
        ("idle", b.idle_time_s, f"{idle_share:.1%} of span"),
        ("span", b.span_s, "first kernel start to last kernel end"),
    )
    lines.append("")
    for label, seconds, note in notes:
        lines.append(f"{label:<{name_width}}  {seconds * 1e3:>{time_width}.3f} ms  {note}")
    return "\n".join(lines)
