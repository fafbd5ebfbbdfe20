"""Reading a trace: the file's GPU kernels, memcpys and memsets, one `Kernel` at a time.

A trace exported with ``torch.profiler.profile(...).export_chrome_trace(path)`` is a JSON object
whose ``traceEvents`` list holds host events (``cpu_op``, ``cuda_runtime``, ...) and device events
(``kernel``, ``gpu_memcpy``, ``gpu_memset``) with ``ts`` and ``dur`` in microseconds. Only the
complete ("X") device events become kernels. The file is read incrementally
(`opgraph.analysis.traces.jsonstream`), so `iter_kernels` runs in memory that does not grow with the
file.

Times must be real: a ``ts`` or ``dur`` that is a number but not finite or beyond ``MAX_TIME_US``
(about 31,700 years) is an error, so sums and differences of times stay finite.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from opgraph.core.limits import MAX_TRACE_BYTES

from .jsonstream import trace_events
from .source import as_path, error

# Event categories (compared lower-cased) that are work done on the GPU; "memcpy" and "memset"
# are what older Kineto versions called gpu_memcpy and gpu_memset.
DEVICE_EVENT_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})

# No clock gets here: Kineto's timestamps are ~1.7e15 us since 1970. Keeping |ts| and dur below
# it keeps every sum over a trace (a billion kernels included) far from overflowing a float.
MAX_TIME_US = 1e18

# Distinct kernel names kept as one string each (a step has hundreds; a hostile file, any number).
MAX_NAMES_KEPT = 100_000


class Kernel(NamedTuple):
    """One GPU kernel, memcpy or memset from a trace; times in microseconds as in the trace.

    An immutable record; a named tuple rather than an attrs class because a trace makes millions
    of them and a tuple is built and unpacked several times faster.

    >>> Kernel("ampere_sgemm_128x64_nn", ts_us=10.0, dur_us=4.0, stream=7, device=0).end_us
    14.0
    """

    name: str
    ts_us: float
    dur_us: float
    stream: int | None
    device: int | None

    @property
    def end_us(self) -> float:
        """When the kernel finished, in trace microseconds."""
        return self.ts_us + self.dur_us


def _as_us(path: Path, name: str, field: str, value: object) -> float | None:
    """A ``ts`` or ``dur`` as a float; None when it is not a number; an error when it is not a
    time any clock gives."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None  # JSON true/false are not numbers; nor are strings or nulls
    if -MAX_TIME_US < value < MAX_TIME_US:
        return float(value)
    shown = f"{value:.6g}" if isinstance(value, float) else f"a {len(str(abs(value)))}-digit number"
    raise error(f'{path}: kernel "{name[:80]}" has a {field} of {shown} us, which no clock gives '
                f"(the limit is {MAX_TIME_US:g} us): the trace is corrupt; export it again")


def _as_id(value: object) -> int | None:
    """A stream or device id as an int, or None when the trace does not give a usable one."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def iter_kernels(path: str | Path, max_bytes: int = MAX_TRACE_BYTES) -> Iterator[Kernel]:
    """The GPU kernels (and GPU memcpy / memset operations) of a Kineto trace, as they are read.

    The file may be plain or gzipped JSON (recognised by its first bytes, not its name), at most
    `max_bytes` once decompressed. Events without numeric ``ts`` and ``dur``, or with a negative
    duration, are skipped. Raises OpgraphError with a one-line message when the file cannot be
    read, is not a trace, holds a time that is not one, or holds no GPU kernels (after the last
    kernel was yielded: consume the iterator to the end before trusting a result).

    Example::

        breakdown(iter_kernels("trace.json.gz"))   # never holds the whole trace
    """
    path = as_path(path, "trace")
    accepted: dict[str, bool] = {}  # event "cat" value -> is it a device category
    names: dict[str, str] = {}  # one string per distinct kernel name
    events = kernels = 0
    for event in trace_events(path, max_bytes):
        events += 1
        if type(event) is not dict or event.get("ph") != "X":
            continue
        cat = event.get("cat")
        if type(cat) is not str:
            continue
        is_device = accepted.get(cat)
        if is_device is None:
            is_device = accepted[cat] = cat.lower() in DEVICE_EVENT_CATEGORIES
        if not is_device:
            continue
        name = event.get("name")
        name = names.setdefault(name, name) if type(name) is str else ""
        if len(names) > MAX_NAMES_KEPT:
            names.clear()
        ts = _as_us(path, name, "ts", event.get("ts"))
        dur = _as_us(path, name, "dur", event.get("dur"))
        if ts is None or dur is None or dur < 0:
            continue
        args = event.get("args")
        if type(args) is dict:
            stream, device = _as_id(args.get("stream")), _as_id(args.get("device"))
        else:
            stream = device = None
        kernels += 1
        yield Kernel(name, ts, dur, stream, device)
    if not kernels:
        raise error(
            f'{path} has no GPU kernels ({events:,} events, none of category "kernel" with a '
            "ts and dur): profile with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"
        )


def read_trace(path: str | Path, max_bytes: int = MAX_TRACE_BYTES) -> list[Kernel]:
    """Every kernel of a trace in a list (`iter_kernels`, kept); see there for the errors.

    Example::

        kernels = read_trace("trace.json.gz")
        kernels[0].name, kernels[0].stream   # ('ampere_sgemm_128x64_nn', 7)
    """
    with gc_paused():
        return list(iter_kernels(path, max_bytes))


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector, restoring its state afterwards.

    Reading a trace allocates millions of dicts, lists and tuples, none of them in a cycle; the
    collector would walk them (and every module loaded) over and over: a third of the time.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
