"""`opgraph compare`: measured category times beside the roofline's, measured over roofline per
row, and the measured MFU against the ceiling. Expected figures are the arithmetic of a trace
built here by hand."""

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware
from opgraph.cli import main
from opgraph.core.errors import OpgraphError
from opgraph.analysis.traces.compare import ROOFLINE_OF, compare, format_comparison

H100 = hardware.get("h100-sxm")
US = 1e-6

# (name, expected kernel category, start µs, duration µs, stream): a hand-made step with gaps
# and one communication kernel on a second stream overlapping an element-wise kernel.
KERNELS = [
    (("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, "
     "unsigned int, 2, 2, -2, true>"), "embedding", 0, 4, 7),
    (("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
     "float>"), "norm", 10, 6, 7),
    (("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
     "segment_k_off_kernel__5x_cublas"), "matmul", 20, 100, 7),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul", 125, 100, 7),
    (("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t>, false, true, false>(Flash_fwd_params)"), "attention", 230, 50, 7),
    (("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<"
     "c10::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<"
     "c10::BFloat16>, at::detail::Array<char*, 3>)"), "elementwise", 290, 20, 7),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
     "communication", 300, 30, 21),  # overlaps the elementwise kernel and the next gap
    (("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
     "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4>>"), "optimizer", 340, 40, 7),
]
KERNEL_TIME = 4 + 6 + 100 + 100 + 50 + 20 + 30 + 40  # µs
SPAN = 380  # first start 0, last end 340 + 40
BUSY = 4 + 6 + 100 + 100 + 50 + (330 - 290) + 40  # the all-reduce covers 310..330 alone
MEASURED = {"embedding": 4, "norm": 6, "matmul": 200, "attention": 50, "elementwise": 20,
            "communication": 30, "optimizer": 40}


def kineto_trace(kernels=KERNELS) -> dict:
    """A PyTorch profiler trace as Kineto writes it: CPU ops and runtime calls besides the GPU
    kernels, which carry `cat: "kernel"` and their device and stream in `args`."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 100, "tid": 100,
               "ts": 1_000_000, "dur": 500, "args": {}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100,
               "tid": 100, "ts": 1_000_010, "dur": 5, "args": {}}]
    for i, (name, _, ts, dur, stream) in enumerate(kernels):
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
                       "ts": 1_000_000 + ts, "dur": dur,
                       "args": {"device": 0, "stream": stream, "correlation": i + 1}})
    return {"schemaVersion": 1, "deviceProperties": [], "traceEvents": events,
            "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000}


@pytest.fixture(scope="module")
def profile():
    return evaluate(compile_step(preset("llama3-8b")), H100)


def by_name(rows):
    return {r["name"] if isinstance(r, dict) else r.name: r for r in rows}


def category(name, time_us, kernels):
    return SimpleNamespace(name=name, time_s=time_us * US, share=time_us / KERNEL_TIME,
                           kernels=kernels)


@pytest.fixture(scope="module")
def measured():
    """What `opgraph.analysis.traces.breakdown` gives for KERNELS, written out by hand."""
    counts = {"matmul": 2}
    cats = [category(n, t, counts.get(n, 1)) for n, t in MEASURED.items()]
    return SimpleNamespace(kernel_time_s=KERNEL_TIME * US, busy_time_s=BUSY * US,
                           idle_time_s=(SPAN - BUSY) * US, span_s=SPAN * US, kernels=len(KERNELS),
                           categories=cats)


def roofline_time(profile, *names):
    return sum(profile.category(n).time_s for n in names)


def test_rows_map_kernel_categories_to_the_roofline(profile, measured):
    c = compare(measured, profile)
    rows = by_name(c.rows)
    matmul = rows["matmul"]
    assert matmul.roofline_categories == ("matmul", "output_head")
    assert matmul.measured_s == pytest.approx(200 * US, rel=1e-12)
    assert matmul.roofline_s == pytest.approx(roofline_time(profile, "matmul", "output_head"),
                                            rel=1e-12)
    assert matmul.ratio == pytest.approx(200 * US / roofline_time(profile, "matmul", "output_head"),
                                       rel=1e-12)
    for kernel, roof in (("attention", "attention"), ("optimizer", "optimizer"),
                         ("norm", "norm"), ("elementwise", "elementwise"),
                         ("embedding", "embedding")):
        assert rows[kernel].ratio == pytest.approx(
            MEASURED[kernel] * US / profile.category(roof).time_s, rel=1e-12)
    comm = rows["communication"]
    assert not comm.modelled and comm.ratio is None and comm.roofline_s is None
    assert comm.measured_s == pytest.approx(30 * US)
    assert c.not_modelled_s == pytest.approx(30 * US)
    # every roofline category is covered once, every measured microsecond appears once
    assert sum(r.roofline_s or 0 for r in c.rows) == pytest.approx(profile.step_time_s, rel=1e-12)
    assert sum(r.measured_s or 0 for r in c.rows) == pytest.approx(KERNEL_TIME * US, rel=1e-12)
    assert sum(r.kernels or 0 for r in c.rows) == len(KERNELS)


def test_measured_mfu(profile, measured):
    c = compare(measured, profile)
    flops = 6 * profile.mfu_parameters * profile.tokens
    assert c.mfu_span == pytest.approx(flops / (SPAN * US * H100.peak_flops), rel=1e-12)
    assert c.mfu_busy == pytest.approx(flops / (BUSY * US * H100.peak_flops), rel=1e-12)
    out = c.to_json()
    assert out["mfu_over_ceiling"] == pytest.approx(c.mfu_span / profile.mfu_ceiling, rel=1e-12)
    assert out["span_over_roofline"] == pytest.approx(SPAN * US / profile.step_time_s)


def test_steps_divide_the_measured_times(profile, measured):
    one, three = compare(measured, profile), compare(measured, profile, steps=3)
    assert three.span_s == pytest.approx(one.span_s / 3, rel=1e-12)
    assert by_name(three.rows)["matmul"].ratio == pytest.approx(by_name(one.rows)["matmul"].ratio / 3)
    assert three.mfu_span == pytest.approx(3 * one.mfu_span, rel=1e-12)


def test_missing_categories_still_listed(profile):
    """A trace with only GEMMs: the other roofline categories are listed, measured at zero."""
    only = SimpleNamespace(kernel_time_s=1e-3, busy_time_s=1e-3, idle_time_s=0.0, span_s=1e-3,
                           kernels=1, categories=[SimpleNamespace(name="matmul", time_s=1e-3,
                                                                  share=1.0, kernels=1)])
    rows = by_name(compare(only, profile).rows)
    assert rows["attention"].measured_s == 0 and rows["attention"].ratio == 0
    assert "communication" not in rows  # no kernels and nothing to compare with
    assert sum(r.roofline_s or 0 for r in rows.values()) == pytest.approx(profile.step_time_s)


def test_no_kernels_is_an_error(profile):
    empty = SimpleNamespace(kernel_time_s=0.0, busy_time_s=0.0, idle_time_s=0.0, span_s=0.0,
                            kernels=0, categories=[])
    with pytest.raises(OpgraphError, match="no GPU kernels"):
        compare(empty, profile, trace="t.json")


def test_table_lists_every_row(profile, measured):
    text = format_comparison(compare(measured, profile, trace="t.json"))
    assert "not modelled" in text and "matmul + output_head" in text
    assert "measured MFU" in text and "MFU ceiling" in text
    assert set(ROOFLINE_OF) >= {"matmul", "attention", "communication", "memory", "other"}


# --- through the command and the real trace reader ---------------------------------------------

@pytest.fixture
def traces():
    return pytest.importorskip("opgraph.analysis.traces")


def test_hand_built_trace_classifies(traces):
    for name, expected, *_ in KERNELS:
        assert traces.classify(name) == expected, name


def test_cli_on_a_hand_built_trace(traces, profile, tmp_path, capsys):
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(kineto_trace(), f)
    assert main(["compare", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kernel_time_s"] == pytest.approx(KERNEL_TIME * US, rel=1e-9)
    assert out["busy_time_s"] == pytest.approx(BUSY * US, rel=1e-9)
    assert out["span_s"] == pytest.approx(SPAN * US, rel=1e-9)
    rows = by_name(out["categories"])
    assert rows["matmul"]["ratio"] == pytest.approx(
        200 * US / roofline_time(profile, "matmul", "output_head"), rel=1e-9)
    assert rows["attention"]["ratio"] == pytest.approx(
        50 * US / profile.category("attention").time_s, rel=1e-9)
    assert rows["communication"]["modelled"] is False
    flops = 6 * profile.mfu_parameters * profile.tokens
    assert out["measured_mfu"] == pytest.approx(flops / (SPAN * US * H100.peak_flops), rel=1e-9)
    assert out["mfu_ceiling"] == pytest.approx(profile.mfu_ceiling, rel=1e-12)
    assert main(["compare", str(path)]) == 0
    assert "measured MFU" in capsys.readouterr().out


def test_cli_bad_trace(traces, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"traceEvents": [')
    assert main(["compare", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("opgraph: error:")


def test_mfu_above_the_ceiling_warns(profile, measured):
    c = compare(measured, profile)  # 380 µs for a whole Llama 3 8B step: not the same run
    assert c.mfu_span > profile.mfu_ceiling and len(c.warnings) == 1
    assert "warning: the measured MFU is above the ceiling" in format_comparison(c)
    slow = SimpleNamespace(**{**vars(measured), "span_s": 2 * profile.step_time_s,
                              "busy_time_s": profile.step_time_s})
    assert compare(slow, profile).warnings == []


def test_cli_extra_rules(traces, profile, tmp_path, capsys):
    """A rule file's categories come first; one with no roofline counterpart is not modelled."""
    path = tmp_path / "step.json"
    path.write_text(json.dumps(kineto_trace()))
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"category": "custom_gemm", "pattern": "^ampere_bf16"}]))
    assert main(["compare", str(path), "--rules", str(rules), "--json"]) == 0
    rows = by_name(json.loads(capsys.readouterr().out)["categories"])
    assert rows["matmul"]["measured_s"] == pytest.approx(100 * US, rel=1e-9)
    assert rows["custom_gemm"]["measured_s"] == pytest.approx(100 * US, rel=1e-9)
    assert rows["custom_gemm"]["modelled"] is False


def test_cli_on_the_shared_traces(traces, shared, capsys):
    """Real traces (none of them a Llama step): the command runs, and the rows account for
    every kernel and for the whole roofline step."""
    traces = sorted((shared / "traces").glob("*.json*"))
    assert traces
    for path in traces:
        assert main(["compare", str(path), "--json"]) == 0, path
        out = json.loads(capsys.readouterr().out)
        rows = out["categories"]
        assert sum(r["measured_s"] or 0 for r in rows) == pytest.approx(out["kernel_time_s"])
        assert sum(r["kernels"] or 0 for r in rows) == out["kernels"]
        assert sum(r["roofline_s"] or 0 for r in rows) == pytest.approx(
            out["roofline_step_time_s"])


def test_an_mfu_over_busy_time_above_the_ceiling_is_warned(shared, cli):
    """AlexNet's trace beside Llama 3 8B: the span MFU is low, the busy-time one is not."""
    code, out, _err = cli("compare", str(shared / "traces" / "alexnet_a100_trace.json.gz"))
    assert code == 0 and "warning: the measured MFU over busy time is above the ceiling" in out


def test_a_calibrated_prediction_is_labelled_as_one_and_not_a_ceiling(measured):
    """Against a calibrated profile the table names the calibrated model, its MFU is a
    prediction, and a run faster than it is no warning (only the roofline is a ceiling)."""
    from opgraph.cost.costmodel import CalibratedCostModel

    calibrated = evaluate(compile_step(preset("llama3-8b")), H100, cost=CalibratedCostModel())
    c = compare(measured, calibrated)  # the 380 µs hand-made step: far faster than predicted
    text = format_comparison(c)
    assert c.mfu_span > calibrated.mfu_ceiling and c.warnings == []
    assert "calibrated ms" in text and "predicted MFU" in text and "ceiling" not in text


H200_TRACE = (Path(__file__).resolve().parents[1] / "benchmarks" / "device" / "h200"
              / "trace_llama3-8b.json.gz")


def test_a_real_llama_step_on_an_h200_against_the_roofline(cli):
    """Two Hugging Face Llama 3 8B training steps on one H200 (benchmarks/device/h200, 1 x 8,192
    tokens, BF16, fused AdamW, SDPA attention), in the repository: every modelled category is
    slower than the roofline's, the span is 876 ms a step as the run's own CUDA events measured
    (within the profiler's overhead), and the measured MFU sits under the ceiling."""
    code, out, _ = cli("compare", str(H200_TRACE), "--model", "llama3-8b", "--hardware", "h200",
                       "--steps", "2", "--json")
    assert code == 0
    j = json.loads(out)
    rows = {r["name"]: r for r in j["categories"]}
    for name in ("matmul", "attention", "elementwise"):
        assert rows[name]["measured_s"] > rows[name]["roofline_s"], name
    assert j["span_s"] == pytest.approx(0.876, rel=0.02)  # results.json: step_median_s 0.8763
    assert 0.3 < j["measured_mfu"] < j["mfu_ceiling"] and j["warnings"] == []
