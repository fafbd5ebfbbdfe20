"""`opgraph.analysis.traces.calibrate`: efficiencies fitted from a measured step against its
roofline.

The traces are built here by hand: each kernel lasts its roofline category's time divided by a
KNOWN efficiency, so the fit must give those efficiencies back. They are read by the reader
`opgraph compare` uses (`read_breakdown`) and set beside the same step's roofline by `compare`.
"""

import gzip
import json
from types import SimpleNamespace

import attrs
import pytest
from opgraph.models import preset

from opgraph.cost import calibration
from opgraph import compile_step, evaluate, hardware
from opgraph.core.categories import CATEGORIES
from opgraph.commands.trace_breakdown import read_breakdown
from opgraph.cost.costmodel import DEFAULT, cost_model, runs_per_charged, shape_factor
from opgraph.core.errors import OpgraphError
from opgraph.analysis.traces import classify
from opgraph.analysis.traces.calibrate import FITTED, SCALED_BY, fit_trace, format_trace_fit
from opgraph.analysis.traces.compare import compare

H100 = hardware.get("h100-sxm")
HOPPER = calibration.get("hopper")
KNOWN = {"matmul": 0.6, "attention": 0.45, "bandwidth": 0.8}

# Roofline category -> a kernel name the trace rules sort into the kernel category measuring it
# (the projections and the output head are both GEMMs: the matmul kernel category covers both).
KERNEL_NAMES = {
    "matmul": ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
               "execute_segment_k_off_kernel__5x_cublas"),
    "output_head": "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
    "attention": ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
                  "cutlass::bfloat16_t>, false, true, false>(Flash_fwd_params)"),
    "norm": ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<"
             "c10::BFloat16, float>"),
    "elementwise": ("void at::native::vectorized_elementwise_kernel<4, at::native::"
                    "CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int, "
                    "at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)"),
    "optimizer": ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
                  "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous "
                  "namespace)::FusedAdamMathFunctor<float, 4>>"),
    "embedding": ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, "
                  "long, unsigned int, 2, 2, -2, true>"),
}
# Kernels the roofline does not model: the fit must ignore them.
UNMODELLED = {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)":
              1500.0, "Memcpy DtoD (Device -> Device)": 40.0}  # name -> µs


@pytest.fixture(scope="module")
def profile():
    return evaluate(compile_step(preset("llama3-8b")), H100)


def waved(profile, category: str) -> float:
    """A category's roofline time with each compute-bound kernel's shape at Hopper's figures
    (a GEMM's waves and K overhead, an attention kernel's exponentials and row overhead:
    `costmodel.shape_factor`) and FlashAttention's backward at the FLOPs it runs
    (`costmodel.runs_per_charged`): what the calibrated model divides by `matmul` or
    `attention` (the memory-bound kernels have no shape)."""
    return sum(op.time_s * (shape_factor(op.kind, profile.grids.get(op.name, ()),
                                         op.flops / op.count, H100, HOPPER)
                            * runs_per_charged(op.kind, DEFAULT)
                            if op.bound == "compute" else 1.0)
               for op in profile.ops if op.category == category)


def kernel_durations(profile, efficiencies=KNOWN, leave_out=()) -> list[tuple[str, float]]:
    """(kernel name, µs) per roofline category: the calibrated model's time of it at
    `efficiencies`, its roofline time (with each GEMM's waves) / the efficiency scaling it."""
    out = [(KERNEL_NAMES[c.name], waved(profile, c.name) / efficiencies[SCALED_BY[c.name]] * 1e6)
           for c in profile.categories if c.name not in leave_out]
    return out + list(UNMODELLED.items())


def write_trace(path, durations, steps=1):
    """A Kineto trace of `steps` copies of the kernels, one after another with 3 µs gaps, beside
    a CPU op and a runtime call as torch.profiler writes them."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0,
               "dur": 10, "args": {}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
               "ts": 2, "dur": 5, "args": {}}]
    ts = 100.0
    for _ in range(steps):
        for name, dur in durations:
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7,
                           "ts": ts, "dur": dur,
                           "args": {"device": 0, "stream": 7, "correlation": len(events)}})
            ts += dur + 3
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def comparison(tmp_path, profile, durations, steps=1):
    """The trace read as `opgraph compare` reads it, beside `profile`."""
    path = write_trace(tmp_path / "step.json.gz", durations, steps)
    args = SimpleNamespace(trace=str(path), rules=None, max_trace_gb=1.0)
    return compare(read_breakdown(args), profile, steps=steps, trace=str(path))


def test_every_roofline_category_follows_one_efficiency_or_none():
    assert set(SCALED_BY) == set(CATEGORIES)
    assert set(SCALED_BY.values()) - {None} == set(FITTED)
    assert set(FITTED) <= set(calibration.FIELDS)


def test_hand_built_kernels_classify_as_their_categories():
    covered = {"output_head": "matmul"}
    for category, name in KERNEL_NAMES.items():
        assert classify(name) == covered.get(category, category), name
    assert {classify(n) for n in UNMODELLED} == {"communication", "memory"}


@pytest.mark.parametrize("steps", [1, 3])
def test_known_efficiencies_are_recovered(tmp_path, profile, steps):
    fit = fit_trace(comparison(tmp_path, profile, kernel_durations(profile), steps), HOPPER)
    e = fit.efficiencies
    for name, value in KNOWN.items():
        assert getattr(e, name) == pytest.approx(value, rel=1e-6), name
    assert e.fitted == ("matmul", "attention", "bandwidth")
    assert fit.notes == ()
    # what one step's categories cannot separate stays the base's
    for name in ("matmul_half_flops", "launch_s", "node", "network", "overlap_slowdown"):
        assert getattr(e, name) == getattr(HOPPER, name), name
    assert e.generation == HOPPER.generation
    sources = dict(e.sources)
    assert "step.json.gz" in sources["matmul"] and sources["node"] == dict(HOPPER.sources)["node"]
    # the rows used: the GEMM kernels against matmul + output_head, the rest one to one
    rows = {name: (roofline, measured) for name, roofline, measured in fit.per_category}
    assert set(rows) == {"matmul", "attention", "norm", "elementwise", "optimizer", "embedding"}
    gemm = profile.category("matmul").time_s + profile.category("output_head").time_s
    gemm_waved = waved(profile, "matmul") + waved(profile, "output_head")
    assert gemm < gemm_waved < 1.1 * gemm  # llama3-8b's GEMMs on an H100: a few % idle slots
    assert rows["matmul"][0] == pytest.approx(gemm_waved, rel=1e-12)
    assert rows["matmul"][1] == pytest.approx(gemm_waved / KNOWN["matmul"], rel=1e-6)
    assert rows["norm"][1] == pytest.approx(profile.category("norm").time_s / 0.8, rel=1e-6)


def test_the_fitted_efficiencies_predict_the_trace(tmp_path, profile):
    """The calibrated model with the fitted values (no launch cost, no host floor, no small-matmul
    term) times each category as the trace measured it, where all its ops are bound by the term
    its efficiency scales: the fit inverts the cost model. The output head is the exception the
    module names: its loss is memory-bound, so the model runs it at `bandwidth`, faster than the
    head's GEMMs."""
    fit = fit_trace(comparison(tmp_path, profile, kernel_durations(profile)), HOPPER)
    e = attrs.evolve(fit.efficiencies, launch_s=0.0, matmul_half_flops=0.0, host_s=0.0)
    calibrated = evaluate(compile_step(preset("llama3-8b")), H100,
                          cost=cost_model("calibrated", table={"hopper": e}))
    term = {"matmul": "compute", "attention": "compute", "bandwidth": "memory"}
    mixed = {o.category for o in profile.ops if o.bound != term[SCALED_BY[o.category]]}
    assert mixed == {"output_head"}
    assert {o.kind for o in profile.ops if o.category == "output_head" and o.bound == "memory"} \
        == {"cross_entropy", "cross_entropy_backward"}
    for c in profile.categories:
        measured = waved(profile, c.name) / KNOWN[SCALED_BY[c.name]]
        if c.name in mixed:
            assert calibrated.category(c.name).time_s < measured
        else:
            assert calibrated.category(c.name).time_s == pytest.approx(measured, rel=1e-6), c.name


def test_a_category_missing_from_the_trace_keeps_the_base_value(tmp_path, profile):
    durations = kernel_durations(profile, leave_out={"attention"})
    fit = fit_trace(comparison(tmp_path, profile, durations), HOPPER)
    e = fit.efficiencies
    assert e.attention == HOPPER.attention
    assert e.matmul == pytest.approx(0.6, rel=1e-6) and e.bandwidth == pytest.approx(0.8, rel=1e-6)
    assert e.fitted == ("matmul", "bandwidth")
    assert dict(e.sources)["attention"] == dict(HOPPER.sources)["attention"]
    assert any(n.startswith("attention: no measured time") for n in fit.notes)
    assert any(n.startswith("attention: nothing measured") for n in fit.notes)
    assert "attention" not in {name for name, *_ in fit.per_category}
    assert "kept (not measured)" in format_trace_fit(fit)


def test_a_missing_memory_bound_category_is_left_out_of_bandwidth(tmp_path, profile):
    """A trace without the optimizer step: bandwidth comes from the other memory-bound rows
    (counting the optimizer's roofline time against no measured time would inflate it)."""
    durations = kernel_durations(profile, leave_out={"optimizer"})
    fit = fit_trace(comparison(tmp_path, profile, durations), HOPPER)
    assert fit.efficiencies.bandwidth == pytest.approx(0.8, rel=1e-6)
    assert "bandwidth" in fit.efficiencies.fitted
    assert [n for n in fit.notes if n.startswith("optimizer")] == [
        ("optimizer: no measured time (no kernel of the trace is classified optimizer); "
         "left out of bandwidth")]


def test_an_unfused_roofline_says_matmul_is_low(tmp_path):
    """Unfused attention's score and weighted-sum products run as GEMMs, which a trace measures
    under matmul; the roofline counts them under attention."""
    unfused = evaluate(compile_step(preset("llama3-8b"), fused_attention=False), H100)
    fit = fit_trace(comparison(tmp_path, unfused, kernel_durations(unfused)), HOPPER)
    assert any("attention is unfused" in n and "matmul is low" in n for n in fit.notes)


def test_a_trace_faster_than_the_roofline_is_an_error(tmp_path, profile):
    durations = kernel_durations(profile, {**KNOWN, "matmul": 1.25})  # 80% of the roofline time
    c = comparison(tmp_path, profile, durations)
    with pytest.raises(OpgraphError) as e:
        fit_trace(c, HOPPER)
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert "faster than the roofline" in message and "matmul efficiency 1.25 > 1" in message
    assert "check that --model, --tokens" in message


def test_an_efficiency_of_exactly_one_is_fitted(tmp_path, profile):
    durations = kernel_durations(profile, {**KNOWN, "attention": 1.0})
    fit = fit_trace(comparison(tmp_path, profile, durations), HOPPER)
    assert fit.efficiencies.attention == pytest.approx(1.0, rel=1e-6)
    assert fit.efficiencies.attention <= 1.0


def test_a_calibrated_profile_is_refused(tmp_path, profile):
    """The fit divides roofline times: against times already divided by efficiencies it would
    fit the remainder."""
    calibrated = evaluate(compile_step(preset("llama3-8b")), H100, cost=cost_model("calibrated"))
    path = write_trace(tmp_path / "step.json.gz", kernel_durations(profile))
    args = SimpleNamespace(trace=str(path), rules=None, max_trace_gb=1.0)
    c = compare(read_breakdown(args), calibrated, trace=str(path))
    with pytest.raises(OpgraphError, match="not the roofline's") as e:
        fit_trace(c, HOPPER)
    assert len(str(e.value).splitlines()) == 1


def test_table_lists_rows_and_efficiencies(tmp_path, profile):
    fit = fit_trace(comparison(tmp_path, profile, kernel_durations(profile)), HOPPER)
    lines = format_trace_fit(fit).splitlines()
    assert lines[0].split() == ["kernels", "roofline", "ms", "measured", "ms", "efficiency"]
    gemm = waved(profile, "matmul") + waved(profile, "output_head")  # with each GEMM's waves
    assert lines[1].split() == ["matmul", f"{gemm * 1e3:.3f}", f"{gemm / 0.6 * 1e3:.3f}", "0.600"]
    assert "efficiencies (hopper)" in lines
    for name, value in KNOWN.items():
        assert f"  {name:<12} {value:.4f}  fitted" in lines


def test_real_traces_fit_or_say_what_to_check(shared, profile):
    """Real traces (none of them a Llama 3 8B step): each either fits, every efficiency a
    fraction in (0, 1], or stops with the one-line error that names what to check."""
    paths = sorted((shared / "traces").glob("*.json*"))
    assert paths
    for path in paths:
        args = SimpleNamespace(trace=str(path), rules=None, max_trace_gb=1.0)
        c = compare(read_breakdown(args), profile, trace=str(path))
        try:
            e = fit_trace(c, HOPPER).efficiencies
        except OpgraphError as error:
            assert len(str(error).splitlines()) == 1 and "check that --model" in str(error)
        else:
            assert all(0 < getattr(e, name) <= 1 for name in FITTED), path


def test_the_calibrate_command_writes_the_fitted_generation(cli, tmp_path, profile):
    """`opgraph calibrate TRACE --model ... --out FILE`: the part's generation gets the fitted
    efficiencies, the other generations stay as shipped; `--cost calibrated --calibration FILE`
    then uses them."""
    trace = tmp_path / "step.json.gz"
    write_trace(trace, kernel_durations(profile))
    out = tmp_path / "mine.toml"
    code, _, err = cli("calibrate", str(trace), "--model", "llama3-8b", "--out", str(out))
    assert code == 0, err
    mine = calibration.load(out)
    for name, value in KNOWN.items():
        assert getattr(mine["hopper"], name) == pytest.approx(value, rel=1e-6)
    assert mine["ampere"] == calibration.catalog()["ampere"]
    code, _, err = cli("profile", "--cost", "calibrated", "--calibration", str(out))
    assert code == 0, err
