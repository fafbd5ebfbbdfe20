"""Text tables of a Profile, for the terminal."""

from __future__ import annotations

from ..profile import Profile


def _bytes(n: float, digits: int = 2) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def _apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` as byte counts with enough digits that two different sizes read differently
    (80,000,283,140 bytes over an 80 GB capacity is not "80.00 GB of 80.00 GB")."""
    for digits in range(2, 10):
        x, y = _bytes(a, digits), _bytes(b, digits)
        if a == b or x != y:
            return x, y
    return f"{a:,.0f} B", f"{b:,.0f} B"


def _pct(x: float) -> str:
    return f"{x * 100:.3f}%" if 0 < x < 0.001 else f"{x * 100:.1f}%"


def format_profile(p: Profile, ops: bool = False) -> str:
    """The `opgraph profile` table: categories, then the step's figures, its peak memory (and
    every op)."""
    batch = p.tokens // p.seq_len
    lines = [
        f"{p.model} on {p.hardware.describe()}",
        (f"{p.tokens:,} tokens per step ({batch} x {p.seq_len:,}), "
         f"{p.attention}, "
         f"{p.parameters:,} parameters{_active(p)}"),
        "",
        f"{'category':<12} {'time (ms)':>10} {'time':>7} {'FLOPs':>8} {'bytes':>10}  bound",
    ]
    for c in p.categories:
        lines.append(f"{c.name:<12} {c.time_s * 1e3:>10.2f} {_pct(c.time_share):>7} "
                     f"{_pct(c.flop_share):>8} {_bytes(c.bytes):>10}  {c.bound}")
    lines += [
        "",
        f"step time    {p.step_time_s * 1e3:.1f} ms (roofline, no overlap)",
        (f"MFU ceiling  {p.mfu_ceiling * 100:.1f}%  (6 x {p.mfu_parameters:,} params x tokens "
         "/ step time x peak)"),
        f"HFU ceiling  {p.hfu_ceiling * 100:.1f}%  (every counted FLOP / step time x peak)",
    ]
    if p.memory is not None:
        lines.append(format_memory(p.memory.to_json()))
    if ops:
        lines += ["", (f"{'op':<36} {'phase':<9} {'kind':<24} {'x':>4} {'time (ms)':>10} "
                       f"{'GFLOP':>10} {'bytes':>10}  bound")]
        for o in p.ops:
            lines.append(f"{o.name:<36} {o.phase:<9} {o.kind:<24} {o.count:>4} "
                         f"{o.time_s * 1e3:>10.3f} {o.flops / 1e9:>10.1f} {_bytes(o.bytes):>10}"
                         f"  {o.bound}")
    return "\n".join(lines)


def _active(p: Profile) -> str:
    """` (12,879,925,248 active per token)` for a mixture of experts, else nothing."""
    active = p.active_parameters
    return f" ({active:,} active per token)" if active is not None else ""


def format_memory(m: dict) -> str:
    """`memory       185.39 GB of 80.00 GB: OVER CAPACITY at loss.grad (weights ..., grads ...,
    optimizer ..., saved activations ..., transient ...)`: the step's peak HBM need by liveness
    (`opgraph.memory`), where it happens, against the part's capacity."""
    total, capacity = _apart(m["total"], m["capacity"] or 0)
    of = f" of {capacity}" if m["capacity"] else " (capacity unknown)"
    over = ": OVER CAPACITY" if m["fits"] is False else ""
    at = f" at {m['peak_op']}" if m["peak_op"] else ""
    return (f"memory       {total}{of}{over}{at} (weights {_bytes(m['weights'])}, "
            f"grads {_bytes(m['gradients'])}, optimizer {_bytes(m['optimizer'])}, "
            f"saved activations {_bytes(m['activations'])}, "
            f"transient {_bytes(m['transient'])})")


def memory_warning(p: Profile) -> str | None:
    """One line for stderr when the step's footprint exceeds the part's memory, else None."""
    m = p.memory.to_json() if p.memory is not None else None
    if not m or m["fits"] is not False:
        return None
    total, capacity = _apart(m["total"], m["capacity"])
    return (f"opgraph: warning: the step needs {total} of HBM, more than the "
            f"{capacity} of one {p.hardware.name}; shard the weights, gradients and "
            "optimizer states (ZeRO/FSDP), checkpoint activations, or pick a larger part")
