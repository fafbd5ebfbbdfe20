"""Read PyTorch profiler (Kineto / Chrome-trace JSON) traces; break GPU time down by kernel kind.

A trace exported with ``torch.profiler.profile(...).export_chrome_trace(path)`` is a JSON object
whose ``traceEvents`` list holds host events (``cpu_op``, ``cuda_runtime``, ...) and device events
(``kernel``, ``gpu_memcpy``, ``gpu_memset``) with ``ts`` and ``dur`` in microseconds. This module
keeps only the device events, sorts each kernel into a category by its name (``KERNEL_RULES``,
first match wins) and reports the time per category, how long the GPU was busy (the union of
kernel intervals over all streams and devices) and how long it sat idle between kernels.

Example::

    kernels = read_trace("step.json.gz")
    print(format_breakdown(breakdown(kernels)))
"""

from __future__ import annotations

import contextlib
import functools
import gc
import gzip
import json
import math
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from opgraph.errors import OpgraphError

__all__ = [
    "KERNEL_RULES",
    "Breakdown",
    "CategoryTime",
    "Kernel",
    "breakdown",
    "classify",
    "format_breakdown",
    "load_rules",
    "read_trace",
]

# Event categories (compared lower-cased) that are work done on the GPU; "memcpy" and "memset"
# are what older Kineto versions called gpu_memcpy and gpu_memset.
DEVICE_EVENT_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})

GZIP_MAGIC = b"\x1f\x8b"

EXPORT_HINT = "export it with torch.profiler's export_chrome_trace"

# The category a kernel lands in when no rule matches.
FALLBACK_CATEGORY = "other"

# Ordered (category, regex) rules, matched case-insensitively with re.search against the kernel
# name; the first rule that matches decides. Why the order is what it is:
# - communication and memory first: their names are unambiguous and must never be taken by a
#   later, looser pattern (an NCCL kernel name ends in "_Sum_float", a memcpy is "Memcpy DtoD").
# - attention before gemm: xFormers' "fmha_cutlassF_..." and cuDNN's "..._sdpa_..._flash_fprop_..."
#   name cutlass / fprop but are fused attention.
# - gemm before everything that names an activation: cutlass and cuDNN convolution kernels carry
#   their epilogue in the name ("..._s16816gemm_relu_...", "cudnn_ampere_scudnn_128x64_relu_...").
#   Convolutions count as gemm: implicit-GEMM (xmma fprop/dgrad/wgrad, implicit_convolve_sgemm),
#   Winograd and cuDNN's FFT convolution (fft2d_r2c / fft2d_c2r around a complex gcgemm) are all
#   the matrix-multiply work of a conv layer. cuBLAS helper kernels whose names mention cuBLAS
#   types (splitKreduce_kernel<...cublasSplitKParams>, the cuBLASLt epilogue kernel) are part of
#   the one matmul call that launched them. "gemm" must not match FBGEMM ("fbgemm_gpu::..."),
#   whose kernels are embedding and sparse-feature ops.
# - norm before elementwise: PyTorch runs batch norm through TensorIterator
#   ("vectorized_elementwise_kernel<...batch_norm_elementwise...>") and Inductor fuses layer norm
#   into Triton kernels ("triton_per_fused_native_layer_norm_0"); both are norm. Inductor's
#   decomposed RMSNorm is a reduction whose fused op list has a mean followed by an rsqrt
#   ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0").
# - embedding before optimizer: FBGEMM fuses the optimizer into the embedding backward
#   ("split_embedding_backward_codegen_rowwise_adagrad_..."), which is embedding work.
# - the "other" rule for Triton reductions (triton_per_ = persistent reduction, triton_red_ =
#   looped reduction) stops them from reaching elementwise just because the fused op list names
#   an activation ("triton_red_fused_gelu_gelu_backward_sum_0" is a bias-gradient reduction).
#   Reductions (reduce_kernel, softmax, pooling, cub scans and sorts) stay in "other": they are
#   neither pointwise nor matrix multiplies. Softmax in particular is not attention: unfused, it
#   may be attention's or the loss's, and the name does not say which.
# - elementwise last: TensorIterator kernels (vectorized_/unrolled_elementwise_kernel, which also
#   run copies, casts and fills), Inductor pointwise kernels (triton_poi_), activation / dropout
#   kernels outside those, and torch.cat's CatArrayBatchedCopy, which like a copy reads and
#   writes each element once.
KERNEL_RULES: tuple[tuple[str, str], ...] = (
    ("communication", (
        r"nccl|rccl|(?<![a-z])all_?reduce|(?<![a-z])all_?gather|reduce_?scatter|sendrecv"
        r"|(?<![a-z])all_?to_?all|cross_device_reduce"
    )),
    ("memory", r"mem(?:cpy|set)"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention|attn"),
    ("gemm", (
        r"cutlass|xmma|cublas|(?<!fb)gemm|gemv|nvjet|cijk_|rocblas|hipblas"
        r"|[sh]\d*cudnn|convolve|conv_depthwise|conv[123]d|dgrad|wgrad|winograd"
        r"|fft2d_[rc]2[rc]|miopen\w*conv|triton_tem\w*mm"
    )),
    ("norm", (
        r"layer_?norm|rms_?norm|batch_?norm|group_?norm|instance_?norm|\bbn_[fb]w"
        r"|gammabeta|rowwisemoments|triton_(?:red|per)_fused\w*mean\w*rsqrt"
    )),
    ("embedding", (
        r"embedding|pooled_embs|index_?select|fbgemm_gpu::|linearize_index|bounds_check_indices"
    )),
    ("optimizer", r"multi_tensor_apply|(?<!h)adam|sgd|adagrad|rmsprop"),
    (FALLBACK_CATEGORY, r"^triton_(?:per|red)_|reduce_kernel|softmax"),
    ("elementwise", (
        r"elementwise|triton_poi_|relu|gelu|silu|swiglu|act_and_mul|dropout|catarraybatchedcopy"
    )),
)

RULE_FILE_KEYS = frozenset({"category", "pattern"})


@dataclass(frozen=True, slots=True)
class Kernel:
    """One GPU kernel, memcpy or memset from a trace; times in microseconds as in the trace.

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


@dataclass(frozen=True, slots=True)
class CategoryTime:
    """GPU time spent in one category of kernels; ``share`` is the fraction of all kernel time."""

    name: str
    time_s: float
    share: float
    kernels: int


@dataclass(frozen=True, slots=True)
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
            "categories": [
                {"name": c.name, "time_s": c.time_s, "share": c.share, "kernels": c.kernels}
                for c in self.categories
            ],
        }


# --------------------------------------------------------------------------- reading traces


def _error(message: str) -> OpgraphError:
    """An OpgraphError whose message is one line even if a file name holds a newline or tab."""
    return OpgraphError("".join(c if c.isprintable() else ascii(c)[1:-1] for c in message))


def _one_line(text: object) -> str:
    """Collapse any whitespace runs (newlines included) so a message stays on one line."""
    return " ".join(str(text).split())


def _read_bytes(path: Path, what: str) -> bytes:
    """The file's bytes, or an OpgraphError saying why it cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise _error(f"{path} does not exist: check the path of the {what}") from None
    except IsADirectoryError:
        raise _error(f"{path} is a directory: pass the path of the {what} file") from None
    except PermissionError:
        message = f"{path} cannot be read (permission denied): check its permissions"
        raise _error(message) from None
    except OSError as err:
        reason = _one_line(err.strerror or err)
        message = f"{path} cannot be read ({reason}): check the path of the {what}"
        raise _error(message) from None


def _decompress(path: Path, data: bytes) -> bytes:
    """Gunzip ``data`` when it starts with the gzip magic bytes, whatever the file is called."""
    if not data.startswith(GZIP_MAGIC):
        return data
    try:
        return gzip.decompress(data)
    except (EOFError, OSError, zlib.error) as err:
        reason = _one_line(err) or type(err).__name__
        raise _error(
            f"{path} is a truncated or corrupt gzip file ({reason}): copy or export the trace again"
        ) from None


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector, restoring its state afterwards.

    Parsing a trace allocates millions of dicts and lists, none of them garbage; the collector
    would walk them over and over, which doubles the time ``json.loads`` takes on a large trace.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _parse_json(path: Path, data: bytes, hint: str) -> object:
    """``json.loads`` with every failure turned into a one-line OpgraphError."""
    try:
        with _gc_paused():
            return json.loads(data)
    except json.JSONDecodeError as err:
        raise _error(
            f"{path} is not JSON (line {err.lineno}, column {err.colno}: "
            f"{_one_line(err.msg)}): {hint}"
        ) from None
    except UnicodeDecodeError:
        raise _error(f"{path} is not JSON (it is not UTF-8 text): {hint}") from None
    except RecursionError:
        raise _error(f"{path} is JSON nested too deeply to be a trace: {hint}") from None


def _trace_events(path: Path, document: object) -> list:
    """The event list of a Chrome trace: ``{"traceEvents": [...]}`` or a bare list of events."""
    if isinstance(document, list):
        return document
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise _error(
            f"{path} is JSON but not a trace (the top level is a {kind}, not an object with "
            f'"traceEvents"): {EXPORT_HINT}'
        )
    if "traceEvents" not in document:
        raise _error(
            f'{path} is JSON but not a trace (it has no "traceEvents" list): {EXPORT_HINT}'
        )
    events = document["traceEvents"]
    if not isinstance(events, list):
        kind = type(events).__name__
        raise _error(
            f'{path} is not a valid trace ("traceEvents" is a {kind}, not a list): {EXPORT_HINT}'
        )
    return events


def _as_us(value: object) -> float | None:
    """A ``ts`` or ``dur`` as a finite float, or None when it is not a usable number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None  # JSON true/false are not numbers; nor are strings or nulls
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return number if math.isfinite(number) else None


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


def _device_kernels(events: list) -> list[Kernel]:
    """Kernel records for the complete ("X") device events; everything else is skipped."""
    accepted: dict[str, bool] = {}  # event "cat" value -> is it a device category
    kernels = []
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        cat = event.get("cat")
        if not isinstance(cat, str):
            continue
        is_device = accepted.get(cat)
        if is_device is None:
            is_device = accepted[cat] = cat.lower() in DEVICE_EVENT_CATEGORIES
        if not is_device:
            continue
        ts = _as_us(event.get("ts"))
        dur = _as_us(event.get("dur"))
        if ts is None or dur is None or dur < 0:
            continue
        name = event.get("name")
        args = event.get("args")
        if isinstance(args, dict):
            stream = _as_id(args.get("stream"))
            device = _as_id(args.get("device"))
        else:
            stream = device = None
        name = name if isinstance(name, str) else ""
        kernels.append(Kernel(name, ts, dur, stream, device))
    return kernels


def read_trace(path: str | Path) -> list[Kernel]:
    """Read the GPU kernels (and GPU memcpy / memset operations) from a Kineto trace file.

    The file may be plain or gzipped JSON (recognised by its first bytes, not its name). Events
    without numeric ``ts`` and ``dur``, or with a negative duration, are skipped. Raises
    OpgraphError with a one-line message when the file cannot be read, is not a trace, or holds
    no GPU kernels.

    Example::

        kernels = read_trace("trace.json.gz")
        kernels[0].name, kernels[0].stream   # ('ampere_sgemm_128x64_nn', 7)
    """
    path = Path(path)
    data = _decompress(path, _read_bytes(path, "trace"))
    events = _trace_events(path, _parse_json(path, data, EXPORT_HINT))
    with _gc_paused():
        kernels = _device_kernels(events)
    if not kernels:
        raise _error(
            f'{path} has no GPU kernels ({len(events):,} events, none of category "kernel" with a '
            "ts and dur): profile with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"
        )
    return kernels


# --------------------------------------------------------------------------- classifying kernels


def _rule_error(where: str, problem: str) -> OpgraphError:
    return _error(
        f"{where} {problem}: each rule is a category name and a Python regular expression"
    )


@functools.lru_cache(maxsize=64)
def _compile_rules(rules: tuple) -> tuple[tuple[str, re.Pattern], ...]:
    """Compile a rules table once per distinct table; patterns match case-insensitively."""
    compiled = []
    for index, rule in enumerate(rules, start=1):
        where = f"kernel rule {index}"
        if not isinstance(rule, tuple) or len(rule) != 2:
            raise _rule_error(where, f"is {rule!r}, not a (category, pattern) pair")
        category, pattern = rule
        if not isinstance(category, str) or not category:
            raise _rule_error(where, f"has category {category!r}, not a non-empty string")
        if isinstance(pattern, re.Pattern):
            pattern = pattern.pattern
        if not isinstance(pattern, str):
            raise _rule_error(where, f"has pattern {pattern!r}, not a string")
        try:
            compiled.append((category, re.compile(pattern, re.IGNORECASE)))
        except re.error as err:
            raise _rule_error(where, f"has a bad pattern {pattern!r} ({_one_line(err)})") from None
    return tuple(compiled)


def _hashable_rules(rules: Iterable) -> tuple:
    """The rules as a tuple of pairs, so that tables given as lists can be cached too."""
    table = tuple(tuple(rule) if isinstance(rule, list) else rule for rule in rules)
    try:
        hash(table)
    except TypeError:
        raise _error("kernel rules must be (category, pattern) pairs of strings") from None
    return table


def _first_match(name: str, compiled: Sequence[tuple[str, re.Pattern]]) -> str:
    for category, regex in compiled:
        if regex.search(name):
            return category
    return FALLBACK_CATEGORY


@functools.lru_cache(maxsize=65536)
def _classify_cached(name: str, rules: tuple) -> str:
    return _first_match(name, _compile_rules(rules))


def classify(name: str, rules: Iterable = KERNEL_RULES) -> str:
    """The category of a kernel name: the first rule whose regex matches it, else ``"other"``.

    Put your own rules in front of the defaults to override them.

    >>> classify("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(...)")
    'gemm'
    >>> classify("my_fused_rope", rules=(("rope", r"my_fused"),) + KERNEL_RULES)
    'rope'
    """
    return _classify_cached(name, _hashable_rules(rules))


def load_rules(path: str | Path, base: Iterable = KERNEL_RULES) -> tuple[tuple[str, str], ...]:
    """Read extra rules from a JSON file and return them followed by ``base`` (the defaults).

    The file holds ``[{"category": "rope", "pattern": "rotary|rope_"}, ...]``; its rules come
    first, so they win over the defaults. Pass ``base=()`` to get the file's rules alone.
    Raises OpgraphError with a one-line message for an unreadable file, a wrong shape or a bad
    regular expression.

    Example::

        rules = load_rules("rules.json")     # rules[0] == ('rope', 'rotary|rope_')
        breakdown(read_trace("trace.json.gz"), rules)
    """
    path = Path(path)
    hint = 'write a list like [{"category": "rope", "pattern": "rotary"}]'
    document = _parse_json(path, _read_bytes(path, "rules file"), hint)
    if not isinstance(document, list):
        kind = type(document).__name__
        raise _error(f"{path} is not a rules file (the top level is a {kind}): {hint}")
    rules = []
    for index, item in enumerate(document, start=1):
        where = f"{path}: rule {index}"
        if not isinstance(item, dict) or set(item) != RULE_FILE_KEYS:
            shown = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise _error(
                f'{where} must be an object with exactly "category" and "pattern" '
                f"(got {shown}): {hint}"
            )
        category, pattern = item["category"], item["pattern"]
        if not isinstance(category, str) or not category.strip():
            raise _error(f"{where} has category {category!r}, not a non-empty string: {hint}")
        if not isinstance(pattern, str):
            raise _error(f"{where} has pattern {pattern!r}, not a string: {hint}")
        try:
            re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise _error(
                f"{where} has a bad pattern {pattern!r} ({_one_line(err)}): "
                "fix the regular expression"
            ) from None
        rules.append((category.strip(), pattern))
    return tuple(rules) + _hashable_rules(base)


# --------------------------------------------------------------------------- breaking time down


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once: sort and sweep."""
    intervals.sort()
    total = 0.0
    run_start, run_end = intervals[0]
    for start, end in intervals:
        if start > run_end:
            total += run_end - run_start
            run_start, run_end = start, end
        elif end > run_end:
            run_end = end
    return total + (run_end - run_start)


def breakdown(kernels: Sequence[Kernel], rules: Iterable = KERNEL_RULES) -> Breakdown:
    """Time per kernel category, plus busy and idle GPU time, in seconds.

    Busy time is the union of all kernel intervals across streams and devices; idle time is the
    rest of the span from the first kernel's start to the last kernel's end. Each distinct kernel
    name is classified once. An empty list gives an all-zero breakdown with no categories.

    >>> b = breakdown([Kernel("ampere_sgemm_128x64_nn", 0.0, 10.0, 7, 0),
    ...                Kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 15.0, 5.0, 20, 0)])
    >>> b.busy_time_s, b.idle_time_s, [c.name for c in b.categories]
    (1.5e-05, 5e-06, ['gemm', 'communication'])
    """
    kernels = list(kernels)  # a generator is fine too
    if not kernels:
        return Breakdown(0.0, 0.0, 0.0, 0.0, 0, [])
    compiled = _compile_rules(_hashable_rules(rules))
    # Measure from the first start: trace timestamps are ~1e15 us, where a float's step is
    # ~0.1 us, so "ts + dur" would round away part of a short kernel; offsets are exact.
    origin = min(kernel.ts_us for kernel in kernels)
    category_of: dict[str, str] = {}
    time_us: dict[str, float] = {}
    counts: dict[str, int] = {}
    intervals = []
    for kernel in kernels:
        name = kernel.name
        category = category_of.get(name)
        if category is None:
            category = category_of[name] = _first_match(name, compiled)
        time_us[category] = time_us.get(category, 0.0) + kernel.dur_us
        counts[category] = counts.get(category, 0) + 1
        start = kernel.ts_us - origin
        intervals.append((start, start + kernel.dur_us))

    kernel_us = math.fsum(time_us.values())
    span_us = max(end for _, end in intervals)
    busy_us = _union_length(intervals)
    categories = [
        CategoryTime(
            name=category,
            time_s=us / 1e6,
            share=us / kernel_us if kernel_us > 0 else 0.0,
            kernels=counts[category],
        )
        for category, us in time_us.items()
    ]
    categories.sort(key=_by_time_then_name)
    return Breakdown(
        kernel_time_s=kernel_us / 1e6,
        busy_time_s=busy_us / 1e6,
        idle_time_s=(span_us - busy_us) / 1e6,
        span_s=span_us / 1e6,
        kernels=len(kernels),
        categories=categories,
    )


def _by_time_then_name(category: CategoryTime) -> tuple[float, str]:
    return (-category.time_s, category.name)


def format_breakdown(b: Breakdown) -> str:
    """A fixed-width text table of the breakdown, for a terminal.

    >>> print(format_breakdown(breakdown([Kernel("ampere_sgemm_128x64_nn", 0.0, 10.0, 7, 0)])))
    category     time (ms)   share  kernels
    gemm             0.010  100.0%        1
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
