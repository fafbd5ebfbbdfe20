"""Text tables of a Profile, for the terminal."""

from __future__ import annotations

from ...cost.profile import Profile


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
    if p.parallel is not None:
        return format_parallel(p, ops)
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
    roofline = p.cost == "roofline"
    lines += [
        "",
        (f"step time    {p.step_time_s * 1e3:.1f} ms "
         f"({'roofline' if roofline else 'calibrated efficiencies'}, no overlap)"),
        (f"MFU{' ceiling' if roofline else '        '}  {p.mfu_ceiling * 100:.1f}%  "
         f"(6 x {p.mfu_parameters:,} params x tokens / step time x peak)"),
        (f"HFU{' ceiling' if roofline else '        '}  {p.hfu_ceiling * 100:.1f}%  "
         "(every counted FLOP / step time x peak)"),
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


def format_parallel(p: Profile, ops: bool = False) -> str:
    """The `opgraph profile` text for a job over many GPUs: rank 0's categories over one
    optimizer step, the step's parts, and its communication by collective and group."""
    r = p.parallel
    lay = r.layout
    batch = p.tokens // p.seq_len
    options = [f"micro-batch {lay.micro_batch}",
               (f"global batch {lay.batch:,} ({lay.micro_batches} micro-batch"
               f"{'es' if lay.micro_batches != 1 else ''} per rank)")]
    ends = [f"the {end} stage {n} layers" for end, n in
            (("first", lay.first_stage_layers), ("last", lay.last_stage_layers)) if n is not None]
    if ends:  # the layout's uneven split, or its framework's (`frameworks.own_split`)
        options.append(" and ".join(ends))
    if lay.stage_layers is not None:
        options.append(f"stages of {'/'.join(map(str, lay.stage_layers))} layers")
    if lay.virtual_stages > 1:
        options.append(f"{lay.virtual_stages} virtual stages")
    zero = f"ZeRO-{lay.zero}" + (
        f" in {lay.replicate} replicas of {lay.size('dp')} ranks (HSDP)" if lay.replicate > 1
        else "")
    options += [zero] + (["sequence parallel"] if lay.sequence_parallel else []) + (
        ["async TP"] if lay.async_tp else []) + (
        ["context parallel by all-to-all (Ulysses)"] if lay.cp > 1 and lay.cp_comm == "a2a"
        else [])
    lines = [
        f"{p.model} on {lay.world:,} x {p.hardware.describe()}",
        f"cluster: {r.cluster.describe()}",
        (f"layout: tp {lay.tp} x cp {lay.cp} x pp {lay.pp} x dp {lay.dp_degree} = "
         f"{lay.world:,} GPUs" + (f", ep {lay.ep}" if lay.ep > 1 else "")
         + "; " + ", ".join(options)),
        (f"{p.tokens:,} tokens per step ({batch:,} x {p.seq_len:,}), {p.attention}, "
         f"{p.mfu_parameters:,} parameters (MFU convention)"),
        "",
        "rank 0 (the first pipeline stage), each op over one optimizer step:",
        f"{'category':<13} {'time (ms)':>10} {'time':>7} {'FLOPs':>8} {'bytes':>10}  bound",
    ]
    for c in p.categories:
        lines.append(f"{c.name:<13} {c.time_s * 1e3:>10.2f} {_pct(c.time_share):>7} "
                     f"{_pct(c.flop_share):>8} {_bytes(c.bytes):>10}  {c.bound}")
    lines += [
        "",
        (f"step time      {r.step_time_s * 1e3:,.1f} ms ({r.cost}; the critical path over the "
         "compute and communication streams)"),
        f"  bubble       {r.bubble_s * 1e3:,.1f} ms (pipeline fill and drain on rank 0)",
        f"  exposed comm {r.exposed_communication_s * 1e3:,.1f} ms (what compute waited for)",
        f"tokens/s/GPU   {r.tokens_per_s_per_gpu:,.0f}",
        (f"MFU{' ceiling' if r.cost == 'roofline' else '        '}    {r.mfu * 100:.1f}%  "
         f"(6 x {p.mfu_parameters:,} params x tokens / step time x peak x GPUs)"),
        format_memory(r.memory.to_json()).replace("memory      ", "memory/GPU  ", 1)
        + (f"; the layers' saved activations of {r.in_flight:g} micro-batches in flight"
           if r.in_flight != 1 else "")
        + (f"; pipeline stage {r.memory_stage}, the fullest" if lay.pp > 1 else ""),
        "",
        (f"{'communication':<28} {'GPUs':>5}  {'tier':<28} {'count':>6} {'time (ms)':>10} "
        f"{'exposed':>9}"),
    ]
    groups: dict = {}
    for t in r.communication:
        key = (t.group, t.collective.replace("_", "-"))
        row = groups.setdefault(key, [t.group_size, t.tier, 0, 0.0, 0.0])
        row[2] += t.count
        row[3] += t.time_s
        row[4] += t.exposed_s
    for (group, kind), (size, tier, count, time, exposed) in groups.items():
        lines.append(f"{group + ' ' + kind:<28} {size:>5}  {tier[:28]:<28} {count:>6,} "
                     f"{time * 1e3:>10.2f} {exposed * 1e3:>9.2f}")
    # the rest of the exposed time, each on a line of its own: waits for a collective that had
    # not begun, and a later pipeline stage's longer tail
    for label, seconds in (("queued (before it began)", r.queued_communication_s),
                           ("a later stage's longer tail", r.later_stage_tail_s)):
        if seconds:
            lines.append(f"{label:<28} {'':>5}  {'':<28} {'':>6} {'':>10} {seconds * 1e3:>9.2f}")
    if ops:
        lines += ["", (f"{'op':<44} {'phase':<9} {'kind':<24} {'x':>5} {'time (ms)':>10} "
                       f"{'GFLOP':>10} {'bytes':>10}")]
        for o in p.ops:
            lines.append(f"{o.name:<44} {o.phase:<9} {o.kind:<24} {o.count:>5} "
                         f"{o.time_s * 1e3:>10.3f} {o.flops / 1e9:>10.1f} {_bytes(o.bytes):>10}")
    return "\n".join(lines)


def _active(p: Profile) -> str:
    """` (12,879,925,248 active per token)` for a mixture of experts, else nothing."""
    active = p.active_parameters
    return f" ({active:,} active per token)" if active is not None else ""


def format_memory(m: dict) -> str:
    """`memory       185.39 GB of 80.00 GB: OVER CAPACITY at loss.grad (weights ..., grads ...,
    optimizer ..., saved activations ..., transient ...)`: the step's peak HBM need by liveness
    (`opgraph.cost.memory`), where it happens, against the part's capacity."""
    total, capacity = _apart(m["total"], m["capacity"] or 0)
    of = f" of {capacity}" if m["capacity"] else " (capacity unknown)"
    over = ": OVER CAPACITY" if m["fits"] is False else ""
    at = f" at {m['peak_op']}" if m["peak_op"] else ""
    return (f"memory       {total}{of}{over}{at} (weights {_bytes(m['weights'])}, "
            f"grads {_bytes(m['gradients'])}, optimizer {_bytes(m['optimizer'])}, "
            f"saved activations {_bytes(m['activations'])}, "
            f"transient {_bytes(m['transient'])}{_buffers(m)})")


def _buffers(m: dict) -> str:
    """`, + gather buffers 5.37 GB` where the reserved peak (`Memory.total`) stacks the
    optimizer's packed gather buffers on the liveness peak; `, gather buffers 5.37 GB not kept`
    where that would pass the capacity (the allocator frees its cache instead); else nothing."""
    if not m.get("buffers"):
        return ""
    from ...cost.memory import PEAK_PARTS

    liveness = sum(m[k] for k in PEAK_PARTS)
    kept = m["total"] == liveness + m["buffers"]
    return f", {'+ ' if kept else ''}gather buffers {_bytes(m['buffers'])}" + (
        "" if kept else " not kept")


def memory_warning(p: Profile) -> str | None:
    """One line for stderr when the step's footprint exceeds the part's memory, else None."""
    m = p.memory.to_json() if p.memory is not None else None
    if not m or m["fits"] is not False:
        return None
    total, capacity = _apart(m["total"], m["capacity"])
    if p.parallel is not None:
        return (f"opgraph: warning: each GPU needs {total} of HBM, more than the {capacity} "
                f"of one {p.hardware.name}; shard further (--zero, --tp, --pp), recompute "
                "activations (--recompute) or lower --micro-batch")
    return (f"opgraph: warning: the step needs {total} of HBM, more than the "
            f"{capacity} of one {p.hardware.name}; shard the weights, gradients and "
            "optimizer states (ZeRO/FSDP), checkpoint activations, or pick a larger part")


def layout_text(layout, recompute: str, precision: str) -> str:
    """A layout in one short line: `tp8 cp1 pp16(7/8/7) dp64 mb1 v1 zero1 sp full bf16`;
    HSDP's replicas after the ZeRO stage (`zero3 rep4`), context parallelism's all-to-all after
    its degree (`cp4 a2a`; ring attention, the default, unsaid), the experts' own
    tensor-parallel degree after theirs where the layout gives one (`ep32 etp1`)."""
    split = ""
    if layout.first_stage_layers is not None or layout.last_stage_layers is not None:
        split = f"({layout.first_stage_layers or '-'}/.../{layout.last_stage_layers or '-'})"
    elif layout.stage_layers is not None:  # every stage's (not read back by `parse_layout`)
        split = f"({'/'.join(map(str, layout.stage_layers))})"
    ep = f" ep{layout.ep}" if layout.ep > 1 else ""
    if layout.expert_tp is not None:  # the experts' own TP degree, where a layout gives it
        ep += f" etp{layout.expert_tp}"
    a2a = " a2a" if layout.cp > 1 and layout.cp_comm == "a2a" else ""
    return (f"tp{layout.tp} cp{layout.cp}{a2a} pp{layout.pp}{split} dp{layout.dp_degree}{ep} "
            f"mb{layout.micro_batch} v{layout.virtual_stages} zero{layout.zero}"
            f"{f' rep{layout.replicate}' if layout.replicate > 1 else ''}"
            f"{' sp' if layout.sequence_parallel else ''} {recompute} {precision}")


# a share of the GPU's memory from which a layout is flagged (`format_plan`): the caching
# allocator's freed blocks, the CUDA context and NCCL's buffers are not in opgraph's figure
NEAR_CAPACITY = 0.95


def format_plan(best, near: bool = True) -> str:
    """`opgraph plan`'s table: the layouts found (`search.Ranked`), best first; the layout
    column 52 wide, or as wide as the longest layout. Beneath, where `near`, the ranks of those
    that need `NEAR_CAPACITY` of the GPU's memory or more (not under a headroom of the user's,
    `--headroom`, whose capacity is what it leaves)."""
    texts = [layout_text(r.layout, r.candidate.recompute, r.candidate.precision) for r in best]
    width = max([52, *map(len, texts)])
    head = (f"{'#':>3}  {'layout':<{width}} {'step (s)':>9} {'tok/s/GPU':>10} {'MFU':>6} "
            f"{'mem/GPU':>9} {'bubble (s)':>10} {'exposed (s)':>11}")
    lines = [head]
    for i, (r, text) in enumerate(zip(best, texts, strict=True), 1):
        res = r.result
        lines.append(f"{i:>3}  {text:<{width}}"
                     f" {res.step_time_s:>9.3f} {res.tokens_per_s_per_gpu:>10,.0f}"
                     f" {_pct(res.mfu):>6} {_bytes(res.memory.total, 1):>9}"
                     f" {res.bubble_s:>10.3f} {res.exposed_communication_s:>11.3f}")
    full = [f"#{i}" for i, r in enumerate(best, 1) if r.result.memory.capacity
            and r.result.memory.total >= NEAR_CAPACITY * r.result.memory.capacity]
    if full and near:
        lines.append(f"{', '.join(full)} need{'s' * (len(full) == 1)} "
                     f"{NEAR_CAPACITY:.0%} of each GPU's memory or more; the CUDA context, "
                     "NCCL's buffers and the caching allocator's freed blocks are not in that "
                     "figure, and such a run may stall or fail (--headroom GB keeps memory free)")
    return "\n".join(lines)


def format_curve(curve) -> str:
    """`opgraph plan --gpus A:B:xF`'s table: each size's best layout, or why it has none."""
    lines = [f"{'GPUs':>7}  {'tok/s/GPU':>10} {'MFU':>6} {'step (s)':>9} {'searched':>9}  "
             "best layout"]
    for n, found in curve:
        if isinstance(found, str):
            lines.append(f"{n:>7,}  {'-':>10} {'-':>6} {'-':>9} {'-':>9}  {found}")
        elif not found.best:
            lines.append(f"{n:>7,}  {'-':>10} {'-':>6} {'-':>9} {found.searched:>9,}  "
                         f"none fits (the smallest needs {_bytes(found.smallest_memory, 1)})")
        else:
            r = found.best[0]
            lines.append(f"{n:>7,}  {r.result.tokens_per_s_per_gpu:>10,.0f} "
                         f"{_pct(r.result.mfu):>6} {r.step_time_s:>9.3f} {found.searched:>9,}  "
                         f"{layout_text(r.layout, r.candidate.recompute, r.candidate.precision)}")
    return "\n".join(lines)


def format_compare(rows) -> str:
    """`opgraph plan --compare`'s table (`explain.compare`): each layout's step split as the
    schedule runs rank 0 (`ParallelResult.parts`), seconds that add up to the step, and its
    memory per GPU beside the headroom to the part's capacity; a layout without figures gives
    its reason, and one that does not fit its figures (a negative headroom) and the reason."""
    from ...parallel.schedule import GROUPS

    seen = {g for row in rows if row.result is not None
            for g, _ in row.result.waited_by_group}
    groups = [g for g in GROUPS if g in seen]
    width = max([52] + [len(row.text) for row in rows if row.result is not None])
    lines = [("why this layout: each step as rank 0 runs it, in seconds: compute + bubble + "
              "the wait for each group's communication + a later stage's longer tail + the "
              "overlap slowdown = step"),
             (f"{'':<6} {'layout':<{width}} {'step (s)':>9} {'MFU':>6} {'compute':>8} {'bubble':>7}"
              + "".join(f" {g + ' comm':>9}" for g in groups)
              + f" {'tail':>7} {'slowdown':>8} {'mem/GPU':>9} {'headroom':>9}")]
    for row in rows:
        if row.result is None:
            lines.append(f"{row.label:<6} {row.reason}")
            continue
        r = row.result
        waited = dict(r.waited_by_group)
        capacity = r.memory.capacity
        headroom = "-"
        if capacity:
            headroom = ("-" if capacity < r.memory.total else "") + _bytes(
                abs(capacity - r.memory.total), 1)
        lines.append(f"{row.label:<6} {row.text:<{width}} {r.step_time_s:>9.3f} {_pct(r.mfu):>6}"
                     f" {r.compute_s:>8.3f} {r.bubble_s:>7.3f}"
                     + "".join(f" {waited.get(g, 0.0):>9.3f}" for g in groups)
                     + f" {r.later_stage_tail_s:>7.3f} {r.overlap_slowdown_s:>8.3f}"
                     f" {_bytes(r.memory.total, 1):>9} {headroom:>9}")
        if row.reason is not None:
            lines.append(f"{'':<6} {row.reason}")
    return "\n".join(lines)


def format_sensitivity(moved, best, error: float) -> str:
    """`opgraph plan --sensitivity`'s lines (`explain.sensitivity`): under each moved cost
    model, the first choice's step and rank among the top layouts, and which is first now."""
    base = best[0].step_time_s
    whats = [f"{p.what} x {p.factor:.3f} ({', '.join(p.names)})" for p in moved]
    width = max([40, *map(len, whats)])
    lines = [(f"how sure: the top {len(best)} scheduled again with the calibrated model moved "
              f"by its error, {error * 100:.1f}% (opgraph validate --cv family: the mean "
              "left-out step-time error)"),
             f"{'moved':<{width}} {'#1 step (s)':>11} {'change':>7} {'#1 rank':>9}  first now"]
    for p, what in zip(moved, whats):
        now = best[p.first].candidate
        first = ("#1, the same" if p.first == 0 else
                 f"#{p.first + 1} {layout_text(now.layout, now.recompute, now.precision)} at "
                 f"{p.steps[p.first]:.3f} s")
        lines.append(f"{what:<{width}} {p.steps[0]:>11.3f} {(p.steps[0] / base - 1) * 100:>+6.1f}%"
                     f" {f'{p.first_rank} of {len(p.steps)}':>9}  {first}")
    stays = sum(p.first_rank == 1 for p in moved)
    lines.append(f"the first choice stays first in {stays} of the {len(moved)} moved models")
    return "\n".join(lines)
