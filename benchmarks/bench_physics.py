"""How far opgraph's predictions of real multi-GPU runs hold: `python benchmarks/bench_physics.py`.

Prints, against the targets of the physics work:

(a) leave one family out: for each family of the shipped dev runs, the calibrated model's
    fitted parameters refitted on every other family, this one predicted (mean absolute error
    of the step time), beside the in-sample error of a fit on all; target <= 12% averaged over
    families, no family above 20%
(b) the roofline at or below the measured step on every dev run (it is a ceiling); beside it
    the held-out runs and the playbook sweep's
(c) predicted peak memory within 10% of the measured GPU memory on >= 90% of the playbook
    sweep's rows; beside it, where that error lies (per sequence of micro-batch, or fixed),
    how far the measured figure repeats itself where every GPU holds the same, the rows with
    TP predicted in both of nanotron's TP modes (no row says which ran), and the same figure
    on the dev runs whose source says it is the allocated peak
(d) on the playbook sweep, grouped by model and node count: median Spearman >= 0.85 of
    predicted and measured throughput, mean regret <= 5% of the first choice; beside it the
    rows that filled their GPUs, the pipelines by where their sends go, what the slowest
    pipelines lost per micro-batch (nanotron's polled pipeline sends), and the figures over
    the rows without pipeline parallelism
(e) Llama 3.1 405B at the Llama 3 paper's layout (8,192 H100s, 16 M tokens, TP 8, PP 16 with
    the uneven 7/8.../7 split; the paper reports 38-43% MFU): the predicted MFU
(f) the plate unchanged: `opgraph profile` (roofline, one H100): 555.1 ms, MFU ceiling 67.2%

Several minutes on two cores: (a) refits the model once per family (25 simplex steps a fit,
against `validate --cv family`'s 60: in-sample 22.9% against 22.5%). `--quick` skips (a).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    from opgraph.cost import calibration
    from opgraph.io.cases import load_cases
    from opgraph.cost.costmodel import cost_model
    from opgraph.analysis.validate import (cross_validate, format_cross_validation, rank,
                                           rank_summary, validate)

    quick = "--quick" in argv
    dev = load_cases()
    if not quick:
        start = time.perf_counter()
        scores = cross_validate(dev, calibration.catalog(), steps=25)
        print("(a) leave one family out (calibrated; target: mean <= 12%, none above 20%)")
        print(format_cross_validation(scores))
        print(f"    {time.perf_counter() - start:.0f} s\n")

    roofline = validate(dev, cost_model("roofline"))
    above = [p for p in roofline.predictions if p.error > 0]
    print(f"(b) the roofline above the measured step on {len(above)} of "
          f"{len(roofline.predictions)} dev runs (target 0)")
    for p in sorted(above, key=lambda p: -p.error):
        print(f"    {p.case.id}: {p.error * 100:+.1f}%")
    for name in ("holdout", "playbook-sweep"):  # no target, and no fit reads them
        others = validate(load_cases(name), cost_model("roofline"))
        over = [p for p in others.predictions if p.error > 0]
        print(f"    and on {len(over)} of the {len(others.predictions)} {name} runs"
              + "".join(f"; {p.case.id} {p.error * 100:+.1f}%" for p in over[:3]))

    sweep = validate(load_cases("playbook-sweep"), cost_model("calibrated"))
    errors = [p.memory_error for p in sweep.predictions if p.memory_error is not None]
    within = sum(abs(e) <= 0.10 for e in errors)
    print(f"\n(c) peak memory within 10% of the measured on {within} of {len(errors)} playbook "
          f"sweep rows ({within / len(errors) * 100:.0f}%; target >= 90%); median error "
          f"{sorted(errors)[len(errors) // 2] * 100:+.1f}%")

    allocated = sorted(p.predicted_allocated_bytes / p.case.measured_peak_memory_bytes - 1
                       for p in sweep.predictions if p.memory_error is not None)
    print(f"    against the allocated peak (the live tensors, without the gather buffers the "
          f"allocator keeps): within 10% on {sum(abs(e) <= 0.10 for e in allocated)}, median "
          f"error {allocated[len(allocated) // 2] * 100:+.1f}%")
    print(memory_split(sweep.predictions))
    print(repeated_memory(sweep.predictions))
    print(tp_modes(sweep.predictions))
    allocated = validate([c for c in dev if c.family in ALLOCATED_MEMORY
                          and c.measured_peak_memory_bytes], cost_model("calibrated"))
    errors = sorted(p.predicted_allocated_bytes / p.case.measured_peak_memory_bytes - 1
                    for p in allocated.predictions)
    within = sum(abs(e) <= 0.10 for e in errors)
    print(f"    the dev runs whose source gives torch's allocated peak "
          f"({', '.join(sorted(ALLOCATED_MEMORY))}): within 10% on {within} of {len(errors)}, "
          f"median error {errors[len(errors) // 2] * 100:+.1f}%, from {errors[0] * 100:+.1f}% to "
          f"{errors[-1] * 100:+.1f}%")

    capacity = {c.part_id: c.part().memory_bytes for c in sweep_cases(sweep)}
    summary = rank_summary(rank(sweep, capacity))
    print(f"\n(d) playbook sweep by model and node count ({len(summary['groups'])} groups): "
          f"median Spearman {summary['median_spearman']:.2f} (target >= 0.85), mean regret "
          f"{summary['mean_regret'] * 100:.1f}% (target <= 5%)")
    print(near_capacity(sweep.predictions, capacity))
    print(pipeline_sends(sweep.predictions))
    print(polled_sends(sweep.predictions))
    print(without_pipelines(sweep, capacity))

    print("\n(e) " + llama3_405b())
    print("\n(f) " + plate())
    print("\n(g) " + by_sequence(validate([c for c in load_cases("holdout")
                                          if c.family.startswith("llm_foundry")],
                                         cost_model("calibrated")).predictions))
    return 0


def by_sequence(predictions) -> str:
    """The held-out LLM Foundry runs' mean absolute error by family and sequence length, with
    the range of the signed errors."""
    buckets = (("up to 2,048 tokens", 0, 2048), ("4,096-8,192", 4096, 8192),
               ("16,384 and more", 16384, 1 << 30))
    lines = ["held out, LLM Foundry's runs by sequence length: mean absolute error "
             "(signed range)"]
    for family in sorted({p.case.family for p in predictions}, reverse=True):
        cells = []
        for name, low, high in buckets:
            errors = [p.error for p in predictions
                      if p.case.family == family and low <= p.case.seq_len <= high]
            if errors:
                low_e, high_e = (round(e * 100) + 0 for e in (min(errors), max(errors)))
                cells.append(f"{name}: {sum(map(abs, errors)) / len(errors) * 100:.1f}% "
                             f"({low_e:+d}% to {high_e:+d}%, {len(errors)} runs)")
        lines.append(f"    {family}: " + "; ".join(cells))
    return "\n".join(lines)


# Families whose source states that the memory figure is the PyTorch caching allocator's
# allocated peak (`torch.cuda.max_memory_allocated`): SimuMax's B200 runs ("peak_alloc_GiB").
# The playbook's figure is nanotron's allocated or reserved peak, which it does not say.
ALLOCATED_MEMORY = frozenset({"simumax_b200"})


def near_capacity(predictions, capacity: dict, share: float = 0.95) -> str:
    """The step-time error of the sweep's rows whose MEASURED memory is at least `share` of
    their part's capacity, beside the others': a run that fills its GPU pays the caching
    allocator's frees and retries, which no prediction of the step holds."""
    full, rest = [], []
    for p in predictions:
        measured = p.case.measured_peak_memory_bytes
        if measured is not None:
            (full if measured >= share * capacity[p.case.hardware] else rest).append(p.error)
    if not full:
        return f"    no row measured at {share:.0%} of its GPU's memory or more"
    full.sort()
    rest.sort()
    return (f"    the {len(full)} rows measured at {share:.0%} of the GPU's memory or more: median "
            f"step-time error {full[len(full) // 2] * 100:+.1f}% (the other {len(rest)}: "
            f"{rest[len(rest) // 2] * 100:+.1f}%)")


def pipeline_sends(predictions) -> str:
    """The sweep's pipelines split by where their stages' sends go (the pp group's members are
    `Parallel.stride("pp")` ranks apart: dp x tp in nanotron's rank order, pp outermost, as in
    Megatron's): all inside one node, some between nodes, or every one between nodes (the
    stride a node's GPUs or more); and by one sequence a micro-batch or more. Per part the
    median of measured over predicted step time, and how many rows ran over 3 x their
    prediction."""
    import statistics

    parts: dict = {}
    for p in predictions:
        c, L = p.case, p.case.parallel
        if L.pp == 1:
            continue
        cluster = c.resolved_cluster()
        where = ("every send between nodes" if L.stride("pp") >= cluster.gpus_per_node
                 else "some sends between nodes" if cluster.for_job(c.gpus).spans_nodes(
                     L.pp, L.stride("pp")) else "inside a node")
        ratio = c.measured_step_time_s / p.predicted_step_time_s
        parts.setdefault((where, L.micro_batch == 1), []).append(ratio)
    lines = ["    the pipelines, measured / predicted step time (median; rows over 3 x):"]
    for (where, one), ratios in sorted(parts.items(), key=lambda kv: (
            ORDER.index(kv[0][0]), kv[0][1])):
        lines.append(f"      {where}, {'one sequence' if one else 'more sequences'} a "
                     f"micro-batch: {statistics.median(ratios):.2f} "
                     f"({sum(r > 3 for r in ratios)} of {len(ratios)})")
    return "\n".join(lines)


ORDER = ("inside a node", "some sends between nodes", "every send between nodes")


def polled_sends(predictions, over: float = 2.0) -> str:
    """What the pipelines that ran over `over` x their prediction lost per micro-batch,
    (measured - predicted) / micro-batches, by pipeline degree: 2 (an end stage sends to and
    receives from one neighbour) or more (a middle stage from two). The sweep's nanotron
    (67c5ebb6, "pp", 2024-12-27, the commit that added this) waits for each pipeline send's
    and receive's two metadata messages by polling `work.is_completed()` with
    `time.sleep(0.1)` between polls (`src/nanotron/parallel/pipeline_parallel/p2p.py`,
    `_send_meta`, `_recv_meta`): a transfer whose peer is not there at once costs its host a
    multiple of 100 ms, during which the stage issues no work. An end stage's micro-batch has
    2 transfers (4 metadata messages), a middle stage's 4 (8): 0.4 and 0.8 s where each
    message's poll sleeps once. Per degree: the rows whose loss lies from that figure to
    1.8 x it, their median, and the rest's."""
    import statistics

    lines = [f"    the pipelines measured over {over:g} x their prediction, the time lost per "
             "micro-batch (nanotron's pipeline sends poll every 0.1 s):"]
    for more, name, polls in ((False, "2", 4), (True, "3 or more", 8)):
        lost = [(p.case.measured_step_time_s - p.predicted_step_time_s)
                / p.case.parallel.micro_batches for p in predictions
                if p.case.parallel.pp > 1 and (p.case.parallel.pp > 2) == more
                and p.case.measured_step_time_s > over * p.predicted_step_time_s]
        low, high = polls * 0.1, polls * 0.1 * 1.8
        near = [x for x in lost if low <= x <= high]
        rest = [x for x in lost if not low <= x <= high]
        lines.append(f"      pipeline degree {name}: {len(near)} of {len(lost)} rows lost "
                     f"{low:.1f}-{high:.2f} s (median {statistics.median(near):.2f} s)"
                     + (f", the other {len(rest)} a median {statistics.median(rest):.2f} s"
                        if rest else ""))
    return "\n".join(lines)


def without_pipelines(report, capacity) -> str:
    """`validate --rank`'s figures over the sweep's rows without pipeline parallelism (a
    subset chosen by layout alone, not by error): the layouts whose steps no pipeline send's
    polling (`polled_sends`) can stretch."""
    import attrs

    from opgraph.analysis.validate import rank, rank_summary

    sub = attrs.evolve(report, predictions=tuple(p for p in report.predictions
                                                 if p.case.parallel.pp == 1))
    summary = rank_summary(rank(sub, capacity))
    return (f"    without pipeline parallelism ({len(sub.predictions)} rows, "
            f"{len(summary['groups'])} groups): median Spearman "
            f"{summary['median_spearman']:.2f}, mean regret {summary['mean_regret'] * 100:.1f}%")


def memory_split(predictions) -> str:
    """Where the sweep's memory error lies: within each group of rows that differ only in
    micro-batch size (same model, nodes, TP, PP, DP, ZeRO), the measured and predicted memory
    as a line in the micro-batch size, its intercept what the step holds whatever the batch
    (weights, gradients, optimizer states) and its slope what one more sequence per
    micro-batch adds (the activations a pipeline stage keeps in flight, the loss's logits);
    the medians over groups of measured over predicted."""
    import statistics

    groups: dict = {}
    for p in predictions:
        c = p.case
        if c.measured_peak_memory_bytes is None:
            continue
        L = c.parallel
        model = c.model if isinstance(c.model, str) else tuple(sorted(c.model.items()))
        key = (model, c.seq_len, c.gpus, L.tp, L.pp, L.cp, L.dp, L.zero)
        groups.setdefault(key, []).append(
            (c.parallel.micro_batch, c.measured_peak_memory_bytes, p.predicted_peak_memory_bytes))
    slopes, intercepts = [], []
    by_tp: dict = {}  # one pipeline stage: the slope's ratio by tensor-parallel degree
    for key, rows in groups.items():
        if len({b for b, _, _ in rows}) < 2:
            continue
        measured, predicted = _line(rows, 1), _line(rows, 2)
        if predicted[0] > 0 and predicted[1] > 0:
            slopes.append(measured[0] / predicted[0])
            intercepts.append(measured[1] / predicted[1])
            if key[4] == 1:
                by_tp.setdefault(key[3], []).append(measured[0] / predicted[0])
    per_tp = ", ".join(f"TP {tp} {statistics.median(r):.2f} ({len(r)})"
                       for tp, r in sorted(by_tp.items()))
    return (f"    split over {len(slopes)} groups differing only in micro-batch size, measured / "
            f"predicted (medians): per sequence of micro-batch (activations) "
            f"{statistics.median(slopes):.2f}, at micro-batch 0 (weights, gradients, optimizer) "
            f"{statistics.median(intercepts):.2f}\n"
            f"    per sequence, one pipeline stage, by TP degree (groups): {per_tp}")


def repeated_memory(predictions, within: float = 0.10) -> str:
    """How far the measured memory repeats itself: rows whose every GPU holds the same (ZeRO-0,
    so the data-parallel degree moves no state; same model, sequence, TP, PP, CP, micro-batch,
    framework) but that ran at different data-parallel degrees, so on different node counts;
    per group of two or more, whether their measured memory agrees within `within`, and how many
    rows one figure per group (any figure, as a prediction of per-GPU memory would be) could
    bring within `within` of what was measured."""
    groups: dict = {}
    for p in predictions:
        c, L = p.case, p.case.parallel
        if c.measured_peak_memory_bytes is None or L.zero != 0:
            continue
        model = c.model if isinstance(c.model, str) else tuple(sorted(c.model.items()))
        key = (model, c.seq_len, L.tp, L.pp, L.cp, L.micro_batch, L.framework)
        groups.setdefault(key, []).append(c.measured_peak_memory_bytes)
    repeated = [sorted(v) for v in groups.values() if len(v) > 1]
    if not repeated:
        return "    no rows repeat one GPU's work"
    agree = sum(v[-1] / v[0] <= 1 + within for v in repeated)
    rows = sum(len(v) for v in repeated)
    # the rows one figure f can cover: those m with |f - m| <= within x m, the most over f
    # (the most is reached at an end of some row's interval; 1e-9 keeps that end in it)
    covered = sum(max(sum(abs(f - m) <= within * m * (1 + 1e-9) for m in v)
                      for f in [m * (1 + s * within) for m in v for s in (-1, 1)])
                  for v in repeated)
    widest = max(repeated, key=lambda v: v[-1] / v[0])
    return (f"    {len(repeated)} groups of rows whose GPUs hold the same (ZeRO-0, only the "
            f"data-parallel degree differs; {rows} rows): measured memory within "
            f"{within * 100:.0f}% of each other in {agree}; one figure per group could bring "
            f"{covered} of the {rows} within {within * 100:.0f}%; the widest "
            f"{widest[0] / 2**30:.1f} to {widest[-1] / 2**30:.1f} GiB")


def tp_modes(predictions, within: float = 0.10) -> str:
    """The sweep's rows with tensor parallelism predicted in both of nanotron's TP modes: its
    script's REDUCE_SCATTER (sequence parallelism, as the cases say) and ALL_REDUCE (none: the
    norms' and residuals' activations whole on every TP rank), which the script's
    `TP_MODES` also lists (`scripts/scaling_benchmarks.py`) and which no row records. How many
    rows each mode's memory puts within `within`, and, among the groups of ZeRO-0 rows whose
    GPUs hold the same (`repeated_memory`) but whose measured memory disagrees, how many have
    their least within `within` of the one mode and their most of the other."""
    import attrs

    from opgraph.analysis.validate import validate
    from opgraph.cost.costmodel import cost_model

    rows = [p for p in predictions if p.case.parallel.tp > 1
            and p.case.measured_peak_memory_bytes is not None]
    if not rows:
        return "    no row runs tensor parallelism"
    other = {p.case.id: p for p in validate(
        [attrs.evolve(p.case, parallel=attrs.evolve(
            p.case.parallel, sequence_parallel=not p.case.parallel.sequence_parallel))
         for p in rows], cost_model("calibrated")).predictions}
    near = {p.case.id: (abs(p.memory_error) <= within, abs(other[p.case.id].memory_error)
                        <= within) for p in rows}
    sp = sum(a for a, _ in near.values())
    ar = sum(b for _, b in near.values())
    either = sum(a or b for a, b in near.values())
    groups: dict = {}
    for p in rows:
        c, L = p.case, p.case.parallel
        if L.zero == 0:
            model = c.model if isinstance(c.model, str) else tuple(sorted(c.model.items()))
            key = (model, c.seq_len, L.tp, L.pp, L.cp, L.micro_batch, L.framework)
            groups.setdefault(key, []).append(p)
    split = [sorted(v, key=lambda p: p.case.measured_peak_memory_bytes)
             for v in groups.values() if len(v) > 1]
    split = [v for v in split if v[-1].case.measured_peak_memory_bytes
             > (1 + within) * v[0].case.measured_peak_memory_bytes]
    both = sum(near[v[0].case.id][0] and near[v[-1].case.id][1] for v in split)
    return (f"    the {len(rows)} rows with TP: within {within * 100:.0f}% as the cases say "
            f"(sequence parallel) {sp}, without it (nanotron's ALL_REDUCE mode) {ar}, one or the "
            f"other {either}; of the {len(split)} groups of them that hold the same but measured "
            f"over {within * 100:.0f}% apart, in {both} the least lies within {within * 100:.0f}% "
            f"of the one and the most of the other")


def _line(rows, column: int) -> tuple[float, float]:
    """Least-squares slope and intercept of `column` of `rows` against their first."""
    xs = [r[0] for r in rows]
    ys = [r[column] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def sweep_cases(report):
    return [p.case for p in report.predictions]


def llama3_405b() -> str:
    """The Llama 3 paper's layout, as `opgraph profile` predicts it."""
    from opgraph.parallel import cluster as clusters
    from opgraph import hardware as hw
    from opgraph.cost.costmodel import cost_model
    from opgraph.parallel.distributed import profile_parallel
    from opgraph.core.errors import OpgraphError
    from opgraph.models import preset
    from opgraph.parallel.parallel import Parallel

    part = hw.get("h100-sxm")
    layouts = {"interleaved, 8 virtual stages": dict(virtual_stages=8),
               "1F1B": {}}
    lines = ["Llama 3.1 405B, 8,192 H100s, 2,048 x 8,192 tokens, TP 8 PP 16 DP 64, first and "
             "last stage 7 layers, Megatron-LM, selective recomputation (paper: 38-43% MFU)"]
    for name, extra in layouts.items():
        try:
            layout = Parallel(tp=8, pp=16, gpus=8192, global_batch=2048, micro_batch=1,
                              sequence_parallel=True, zero=1, first_stage_layers=7,
                              last_stage_layers=7, framework="megatron", **extra)
            r = profile_parallel(preset("llama3.1-405b"), part, layout,
                                 cluster=clusters.for_hardware(part), values={"S": 8192},
                                 cost=cost_model("calibrated"), recompute="selective").parallel
            lines.append(f"    {name}: step {r.step_time_s:.2f} s, MFU {r.mfu * 100:.1f}%, "
                         f"memory {r.memory.total / 1e9:.1f} GB")
        except OpgraphError as e:
            lines.append(f"    {name}: not modelled: {e}")
    return "\n".join(lines)


def plate() -> str:
    from opgraph.cli import main as cli

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(["profile", "--json"])
    import json

    data = json.loads(out.getvalue())
    return (f"the plate: step {data['step_time_s'] * 1e3:.1f} ms, MFU ceiling "
            f"{data['mfu_ceiling'] * 100:.1f}% (target 555.1 ms, 67.2%)")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
