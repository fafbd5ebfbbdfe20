"""`opgraph calibrate`: fit the calibrated cost model's efficiencies, to published runs
(`--fit CASES.json`), to a real profiler trace of a known model (`TRACE.json --model ...`), or
a generation's matmul shape to a table of measured GEMMs (`--gemms TABLE.csv --hardware ...`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs

from ..core.errors import OpgraphError
from ..core.limits import MAX_FIT_CASES
from ..io.outputs.atomic import outputs
from .args import check_command_outputs, json_text, positive_int
from .options import add_model_args
from .trace_breakdown import add_trace_args

SHIPPED_COMMAND = "opgraph calibrate --fit shipped --out opgraph/calibration.toml"
SHIPPED_CASES = "shipped"  # `--fit shipped`: the published runs installed with the package


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the calibrated cost model's efficiencies to runs or a trace",
        description="--fit CASES.json: fit the efficiencies the calibration file marks as "
                    "fitted (one value per name, shared by the generations that fit it) to the "
                    "cases' measured step times (least squares on the log error, each family "
                    "weighted equally; the errors printed are in-sample). TRACE: fit "
                    "matmul, attention and HBM bandwidth efficiencies of the part's generation "
                    "from a PyTorch profiler trace of the --model step. --gemms TABLE.csv: the "
                    "--hardware part's generation's matmul tile, K overhead and sustained "
                    "efficiency from measured GEMMs (rows of m, n, k, tflops). --attention "
                    "TABLE.csv: its attention rates and row overheads from measured causal "
                    "attention kernels. The shipped "
                    f"efficiencies are rebuilt by `{SHIPPED_COMMAND}`.")
    p.add_argument("trace", nargs="?", metavar="TRACE",
                   help="a Kineto trace (.json or .json.gz) of the step --model describes")
    p.add_argument("--fit", metavar="CASES.json",
                   help="fit to the runs of a case file; `--fit shipped`: the published runs "
                        "installed with opgraph (opgraph/data/validation.json), from any "
                        f"directory; at most {MAX_FIT_CASES} cases")
    p.add_argument("--gemms", metavar="TABLE.csv",
                   help="fit the --hardware part's generation's matmul shape (tile, K overhead) "
                        "and sustained efficiency to a CSV of measured GEMMs with a header "
                        "naming m, n, k and tflops (benchmarks/device/measure_gpu.py writes "
                        "one), or a table installed with opgraph by name: h200 (measured on "
                        "one H200 SXM), b200 (SimuMax's B200 table)")
    p.add_argument("--attention", metavar="TABLE.csv",
                   help="fit the --hardware part's generation's attention rates (attention, "
                        "attention_fused) and row overheads to a CSV of measured causal "
                        "attention kernels with a header naming backend (flash or cudnn), "
                        "head_dim, seq, fwd_tflops and bwd_tflops (the backward counted at 2.5 x "
                        "the forward's FLOPs), or a table installed with opgraph by name: h200 "
                        "(measured on one H200 SXM)")
    p.add_argument("--select", metavar="TEXT",
                   help="with --fit: only the cases whose id contains TEXT (fit on some runs, "
                        "validate on the others)")
    p.add_argument("--out", metavar="FILE.toml",
                   help="write the calibration file (use it with --cost calibrated "
                        "--calibration FILE.toml)")
    add_model_args(p)
    p.add_argument("--steps", type=positive_int, default=1,
                   help="with TRACE: training steps the trace holds (default 1)")
    add_trace_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..core.errors import OpgraphError
    from ..cost import calibration

    given = [x for x in (args.trace, args.fit, args.gemms, args.attention) if x is not None]
    if len(given) != 1:
        raise OpgraphError("give one thing to fit: a trace, --fit CASES.json, "
                           "--gemms TABLE.csv or --attention TABLE.csv")
    check_command_outputs(args, {"--out": args.out}, {"--out": (".toml",)})
    base = calibration.load(args.calibration) if args.calibration else calibration.catalog()
    source = args.calibration or str(calibration.CATALOG)
    if args.fit is not None:
        table, text, report = _fit_cases(args, base)
    elif args.gemms is not None:
        table, text, report = _fit_gemms(args, base)
    elif args.attention is not None:
        table, text, report = _fit_attention(args, base)
    else:
        table, text, report = _fit_trace(args, base)
    if args.out:
        from ..analysis.fit import to_toml
        from ..io.outputs.atomic import write_atomic

        toml = to_toml(table, calibration.header(source))
        with outputs():
            write_atomic(args.out, lambda f: f.write(toml))
    print(json_text(report) if args.json else text)
    if args.out and not args.json:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _fit_cases(args, base):
    from ..analysis.fit import fit
    from ..io.cases import load_cases, select

    path = None if args.fit == SHIPPED_CASES else args.fit
    cases = load_cases(path, most=(MAX_FIT_CASES, "a fit"), pattern=args.select)
    result = fit(select(cases, args.select), base)
    errors = [e for _, _, e in result.errors]
    mape = sum(map(abs, errors)) / len(errors)
    lines = ["fitted (in-sample: the errors below are on the runs the fit used)"]
    for generation, e in result.table.items():
        if e.fitted and any(g == generation for _, g, _ in result.errors):
            values = ", ".join(f"{n} = {getattr(e, n):.6g}" for n in e.fitted)
            lines.append(f"  {generation}: {values}")
    lines += ["", f"{'case':<40} {'generation':<10} {'error':>8}"]
    lines += [f"{cid:<40} {g:<10} {err * 100:>+7.1f}%" for cid, g, err in result.errors]
    worst = max(result.errors, key=lambda row: abs(row[2]))
    lines += ["", (f"mean absolute error {mape * 100:.1f}% in-sample over {len(errors)} cases; "
                  f"worst {worst[2] * 100:+.1f}% ({worst[0]})")]
    report = {"fitted": {g: {n: getattr(e, n) for n in e.fitted}
                         for g, e in result.table.items() if e.fitted},
              "cases": [{"id": c, "generation": g, "error": err} for c, g, err in result.errors],
              "mape": mape, "max_error": abs(worst[2]), "in_sample": True}
    return result.table, "\n".join(lines), report


def _fit_gemms(args, base):
    """The part's generation's matmul tile, K overhead and sustained efficiency from a table of
    measured GEMMs (`opgraph.cost.gemms`), the GEMMs shorter than `gemms.MIN_SECONDS` left out."""
    from ..cost import calibration, gemms
    from .common import load_hardware

    part = load_hardware(args)
    generation = calibration.for_hardware(part, base)
    path = gemms.locate(args.gemms)
    rows = gemms.read(path)
    kept = [g for g in rows if gemms.seconds(g) >= gemms.MIN_SECONDS]
    if not kept:
        raise OpgraphError(f"{path}: every GEMM ran under {gemms.MIN_SECONDS * 1e6:.0f} us, "
                           "where the host's launches set the time; measure larger ones")
    peak = part.peak_flops * part.clock_ratio / 1e12  # the rate a sustained clock allows
    best = gemms.fit(kept, peak, part.sms or 0)
    current = gemms.judge(kept, peak, part.sms or 0, int(generation.matmul_tile_m),
                          int(generation.matmul_tile_n), int(generation.matmul_k_overhead))
    flat = gemms.judge(kept, peak, part.sms or 0, 0, 0, 0)
    shown = f"opgraph/data/{Path(path).name}" if args.gemms in gemms.shipped() else args.gemms
    source = (f"measured: {shown}, {len(kept)} GEMMs on {part.name} "
              f"(`opgraph calibrate --gemms`: tile and K overhead of least squared log error)")
    values = {"matmul_tile_m": float(best.tile_m), "matmul_tile_n": float(best.tile_n),
              "matmul_k_overhead": float(best.k0)}
    # A `matmul` the generation fits to published runs stays theirs: one GPU's sustained rate
    # is not what a many-GPU step's GEMMs reach (`--fit` refits it over this shape).
    keeps_matmul = "matmul" in generation.fitted
    if not keeps_matmul:
        values["matmul"] = best.matmul
    sources = dict(generation.sources) | {n: source for n in values}
    fitted = attrs.evolve(generation, **values, sources=tuple(sorted(sources.items())))
    table = {**base, generation.generation: fitted}
    clocks = sorted(g.sm_mhz for g in kept if g.sm_mhz)
    lines = [f"GEMM table {shown}: {len(kept)} GEMMs on {part.name} ({generation.generation}"
             f"), {peak:g} TFLOP/s BF16 dense; {len(rows) - len(kept)} under "
             f"{gemms.MIN_SECONDS * 1e6:.0f} us left out (host-bound)",
             f"measured {min(g.tflops for g in kept):,.0f}-{max(g.tflops for g in kept):,.0f} "
             f"TFLOP/s" + (f"; SM clock median {clocks[len(clocks) // 2]:,.0f} MHz"
                           if clocks else ""),
             "", f"{'shape model':<54} {'matmul':>7} {'mean |err|':>11} {'worst':>7}"]
    for name, f in (("one rate, no shape", flat),
                    (f"{generation.generation} as calibrated ({_shape_text(current)})", current),
                    (f"fitted ({_shape_text(best)})", best)):
        lines.append(f"{name:<54} {f.matmul:>7.3f} {f.mean_error * 100:>10.1f}% "
                     f"{f.worst_error * 100:>6.1f}%")
    lines += ["", f"{generation.generation}: " + ", ".join(
        f"{n} = {v:.4g}" for n, v in values.items()) + " (in-sample: the errors are on the "
        "GEMMs the fit used)"]
    if keeps_matmul:
        lines.append(f"matmul stays {generation.matmul:.4g}: the calibration fits it to published "
                     f"runs (`opgraph calibrate --fit`, which keeps this shape); the table's "
                     f"sustained rate is {best.matmul:.3f}")
    report = {"generation": generation.generation, "hardware": part.id, "gemms": len(kept),
              "left_out": len(rows) - len(kept), "efficiencies": values,
              "sustained_matmul": best.matmul,
              "models": {k: attrs.asdict(f) for k, f in
                         (("flat", flat), ("given", current), ("fitted", best))},
              "in_sample": True}
    return table, "\n".join(lines), report


def _fit_attention(args, base):
    """The part's generation's attention rates and row overheads from a table of measured
    causal attention kernels (`opgraph.cost.attention_table`)."""
    from ..cost import attention_table, calibration
    from .common import load_hardware

    part = load_hardware(args)
    generation = calibration.for_hardware(part, base)
    path = attention_table.locate(args.attention)
    rows = attention_table.read(path)
    peak = part.peak_flops * part.clock_ratio / 1e12
    lines = attention_table.fit(rows, peak)
    values = attention_table.efficiencies(lines)
    shown = (f"opgraph/data/{Path(path).name}" if args.attention in attention_table.shipped()
             else args.attention)
    source = (f"measured: {shown}, {len(rows)} causal attention kernels on {part.name} "
              f"(`opgraph calibrate --attention`: 1 / rate = (1 / rate_inf)(1 + 2k / S) per "
              f"backend and direction at head dim {attention_table.REFERENCE_HEAD_DIM}; rates "
              "over a forward and its backward, k the backends' mean)")
    sources = dict(generation.sources) | {n: source for n in values}
    fitted = attrs.evolve(generation, **values, sources=tuple(sorted(sources.items())))
    text = [f"attention table {shown}: {len(rows)} causal kernels on {part.name} "
            f"({generation.generation}), {peak:g} TFLOP/s BF16 dense",
            "", f"{'backend':<8} {'head dim':>8} {'direction':>9} {'long-row rate':>13} "
            f"{'k (keys)':>8} {'worst':>6}"]
    text += [f"{x.backend:<8} {x.head_dim:>8} {x.direction:>9} {x.rate:>13.3f} "
             f"{x.overhead:>8.0f} {x.worst * 100:>5.1f}%" for x in lines]
    text += ["", f"{generation.generation}: " + ", ".join(
        f"{n} = {v:.4g}" for n, v in values.items()) + " (in-sample: the errors are on the "
        "kernels the fit used)"]
    report = {"generation": generation.generation, "hardware": part.id, "kernels": len(rows),
              "efficiencies": values, "lines": [attrs.asdict(x) for x in lines],
              "in_sample": True}
    return {**base, generation.generation: fitted}, "\n".join(text), report


def _shape_text(f) -> str:
    tile = f"{f.tile_m} x {f.tile_n} tiles" if f.tile_m else "no waves"
    return f"{tile}, K overhead {f.k0}"


def _fit_trace(args, base):
    """The part's generation's matmul, attention and bandwidth efficiencies from the trace of
    the step the model options describe (profiled on the roofline: the fit's reference)."""
    from ..analysis.traces.calibrate import fit_trace, format_trace_fit
    from ..analysis.traces.compare import compare
    from ..cost import calibration
    from ..passes.evaluate import evaluate
    from .common import setup
    from .trace_breakdown import read_breakdown

    args = argparse.Namespace(**{**vars(args), "cost": "roofline", "calibration": None})
    s = setup(args)  # bad model options fail before a large trace is read
    generation = calibration.for_hardware(s.hardware, base)
    measured = read_breakdown(args)
    roofline = evaluate(s.step, s.hardware, s.values, cost=s.cost)
    result = fit_trace(compare(measured, roofline, steps=args.steps, trace=args.trace),
                       generation)
    table = {**base, generation.generation: result.efficiencies}
    report = {"generation": generation.generation,
              "efficiencies": {n: getattr(result.efficiencies, n)
                               for n in result.efficiencies.fitted},
              "categories": [{"category": c, "roofline_s": r, "measured_s": m}
                             for c, r, m in result.per_category],
              "notes": list(result.notes)}
    return table, format_trace_fit(result), report
