"""The Kineto trace reader: a trace written by hand with known answers, the real traces in
../shared/traces, every kind of bad input, rule extension and the trace-breakdown command."""

import argparse
import functools
import gzip
import json
from pathlib import Path

import pytest

from opgraph.commands import trace_breakdown
from opgraph.core.errors import OpgraphError
from opgraph.analysis.traces import (KERNEL_RULES, Kernel, breakdown, classify, format_breakdown,
                                     load_rules, read_trace)

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
REAL_TRACES = (
    sorted(p for p in TRACES.iterdir() if p.name.endswith((".json", ".json.gz")))
    if TRACES.is_dir()
    else []
)

T0 = 1_700_000_000_000_000  # a realistic Kineto timestamp, in microseconds

GEMM = "sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x32_stage3_warpsize2x2x1_kernel"
GELU = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::"
    "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}, at::detail::Array<char*, 2> >"
)
LAYER_NORM = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
CUTLASS_RELU = "void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn>"

# (name, event category, start, end, stream) of every GPU event in the hand-written trace,
# times in microseconds after T0, and the category each must land in.
HAND_KERNELS = [
    (GEMM, "kernel", 0, 10, 7, "matmul"),
    (GELU, "kernel", 5, 12, 8, "elementwise"),  # overlaps the gemm on another stream
    (LAYER_NORM, "kernel", 2, 4, 9, "norm"),  # inside the gemm's interval
    (NCCL, "kernel", 20, 25, 20, "communication"),  # after a gap of 8 us
    ("Memset (Device)", "gpu_memset", 26, 27, 7, "memory"),
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 27, 29, 8, "memory"),  # touches the memset
    (CUTLASS_RELU, "Kernel", 30, 31, 7, "matmul"),  # upper-case category, "relu" in its name
]


def _complete(name, cat, start, end, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7,
            "ts": T0 + start, "dur": end - start, "args": args}


def hand_trace() -> dict:
    """A small trace with known kernels, plus host events and malformed kernels to skip."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
        _complete("aten::mm", "cpu_op", -5, 40),
        _complete("cudaLaunchKernel", "cuda_runtime", -2, 1),
        _complete("ProfilerStep#3", "user_annotation", -6, 41),
        {"ph": "s", "cat": "ac2g", "id": 1, "pid": 0, "tid": 1, "ts": T0 - 2, "name": "ac2g"},
        {"ph": "f", "cat": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": T0, "name": "ac2g"},
        {"ph": "i", "cat": "kernel", "name": "an instant, not a complete event", "ts": T0 + 3},
        {"ph": "X", "cat": "kernel", "name": "no duration", "ts": T0 + 50, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "text duration", "ts": T0 + 50, "dur": "5"},
        "not an event",
    ]
    for name, cat, start, end, stream, _ in HAND_KERNELS:
        events.append(_complete(name, cat, start, end, stream=stream, device=0, correlation=1))
    return {"schemaVersion": 1, "traceEvents": events}


def write(path: Path, document, compress: bool = False) -> Path:
    data = json.dumps(document).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


# --------------------------------------------------------------------------- the hand-built trace


def test_hand_trace_kernels_and_classes(tmp_path):
    kernels = read_trace(write(tmp_path / "step.json.gz", hand_trace(), compress=True))
    assert [k.name for k in kernels] == [row[0] for row in HAND_KERNELS]
    assert [classify(k.name) for k in kernels] == [row[5] for row in HAND_KERNELS]
    gemm = kernels[0]
    assert (gemm.ts_us, gemm.dur_us, gemm.stream, gemm.device) == (T0, 10.0, 7, 0)
    assert gemm.end_us == T0 + 10


def test_hand_trace_times_are_exact(tmp_path):
    b = breakdown(read_trace(write(tmp_path / "step.json", hand_trace())))
    kernel = (10 - 0) + (12 - 5) + (4 - 2) + (25 - 20) + (27 - 26) + (29 - 27) + (31 - 30)
    busy = (12 - 0) + (25 - 20) + (29 - 26) + (31 - 30)  # the union of the intervals
    span = 31 - 0
    assert b.kernels == len(HAND_KERNELS)
    assert b.kernel_time_s == kernel / 1e6
    assert b.busy_time_s == busy / 1e6
    assert b.span_s == span / 1e6
    assert b.idle_time_s == (span - busy) / 1e6
    times = {c.name: c.time_s for c in b.categories}
    assert times == {
        "matmul": ((10 - 0) + (31 - 30)) / 1e6,
        "elementwise": (12 - 5) / 1e6,
        "communication": (25 - 20) / 1e6,
        "memory": ((27 - 26) + (29 - 27)) / 1e6,
        "norm": (4 - 2) / 1e6,
    }
    assert sum(times.values()) == pytest.approx(b.kernel_time_s, rel=1e-12)
    assert sum(c.share for c in b.categories) == pytest.approx(1.0)
    assert [c.name for c in b.categories] == ["matmul", "elementwise", "communication", "memory",
                                              "norm"]
    assert {c.name: c.kernels for c in b.categories}["memory"] == 2


def test_bare_event_list_and_gzip_found_by_magic(tmp_path):
    events = hand_trace()["traceEvents"]
    plain = breakdown(read_trace(write(tmp_path / "list.json", events)))
    gzipped_as_json = read_trace(write(tmp_path / "misnamed.json", events, compress=True))
    plain_as_gz = read_trace(write(tmp_path / "misnamed.json.gz", events))
    assert breakdown(gzipped_as_json) == plain == breakdown(plain_as_gz)


def test_to_json_has_exactly_the_documented_keys(tmp_path):
    j = breakdown(read_trace(write(tmp_path / "t.json", hand_trace()))).to_json()
    assert set(j) == {"kernel_time_s", "busy_time_s", "idle_time_s", "span_s", "kernels",
                      "categories"}
    for c in j["categories"]:
        assert set(c) == {"name", "time_s", "share", "kernels"}
    assert json.loads(json.dumps(j)) == j


def test_format_breakdown_lists_categories_and_totals(tmp_path):
    text = format_breakdown(breakdown(read_trace(write(tmp_path / "t.json", hand_trace()))))
    lines = text.splitlines()
    assert lines[0].split() == ["category", "time", "(ms)", "share", "kernels"]
    gemm_us, kernel_us = (10 - 0) + (31 - 30), sum(end - start for _, _, start, end, _, _ in
                                                   HAND_KERNELS)
    assert lines[1].split() == ["matmul", f"{gemm_us / 1000:.3f}", f"{gemm_us / kernel_us:.1%}",
                                "2"]
    idle, span = 31 - ((12 - 0) + (25 - 20) + (29 - 26) + (31 - 30)), 31
    assert f"{idle / span:.1%} of span" in text
    assert len({len(line) for line in lines[1:6]}) == 1  # the table rows line up


def test_breakdown_of_no_kernels_is_all_zero():
    b = breakdown([])
    assert (b.kernel_time_s, b.busy_time_s, b.idle_time_s, b.span_s, b.kernels) == (0, 0, 0, 0, 0)
    assert b.categories == []


# --------------------------------------------------------------------------- the real traces


@functools.cache
def real(name: str):
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"{path} is not there")
    kernels = read_trace(path)
    return kernels, breakdown(kernels)


def categories_of(kernels, needle: str) -> set[str]:
    return {classify(k.name) for k in kernels if needle.lower() in k.name.lower()}


@pytest.mark.skipif(not REAL_TRACES, reason="../shared/traces is not beside the repo")
@pytest.mark.parametrize("path", REAL_TRACES, ids=lambda p: p.name)
def test_every_real_trace_is_consistent(path):
    kernels, b = real(path.name)
    assert b.kernels == len(kernels) > 0
    assert sum(c.time_s for c in b.categories) == pytest.approx(b.kernel_time_s, rel=1e-9)
    assert sum(c.kernels for c in b.categories) == b.kernels
    assert 0 < b.busy_time_s <= b.kernel_time_s * (1 + 1e-9)
    assert b.busy_time_s <= b.span_s * (1 + 1e-9)
    assert b.idle_time_s >= 0
    assert b.idle_time_s == pytest.approx(b.span_s - b.busy_time_s, abs=1e-12)
    assert [c.time_s for c in b.categories] == sorted((c.time_s for c in b.categories),
                                                      reverse=True)
    assert all(c.kernels > 0 for c in b.categories)


def test_recsys_trace_has_adam_nccl_and_embedding_kernels():
    kernels, b = real("recsys_training_trace.json.gz")
    assert b.kernels == 8568 + 654 + 228  # kernels, memsets, memcpys (counted in the file)
    assert categories_of(kernels, "AdamFunctor") == {"optimizer"}
    assert categories_of(kernels, "nccl") == {"communication"}
    assert categories_of(kernels, "split_embedding") == {"embedding"}
    assert categories_of(kernels, "fbgemm_gpu::") == {"embedding"}  # not gemm
    assert categories_of(kernels, "layer_norm") == {"norm"}
    counts = {c.name: c.kernels for c in b.categories}
    assert counts["optimizer"] == 48
    assert counts["communication"] == 42 + 18  # SendRecv and AllReduce
    assert {k.stream for k in kernels} == {7, 20, 21, 22} and {k.device for k in kernels} == {3}


def test_mi250_rocblas_kernels_are_gemm():
    kernels, b = real("mi250_minitoy_train_ROCm6_2_kineto.json.gz")
    assert b.kernels == 14 + 2
    cijk = [k for k in kernels if k.name.startswith("Cijk_")]
    assert len(cijk) == 2
    assert {classify(k.name) for k in cijk} == {"matmul"}
    assert categories_of(kernels, "multi_tensor_apply") == {"optimizer"}


def test_triton_trace_kernel_is_elementwise():
    kernels, b = real("triton_example.json.gz")
    assert [k.name for k in kernels] == ["triton_poi_fused_add_cos_sin_0"]
    assert [c.name for c in b.categories] == ["elementwise"]
    assert b.busy_time_s == b.kernel_time_s == b.span_s and b.idle_time_s == 0


def test_alexnet_trace_has_gemm_and_conv_kernels():
    kernels, b = real("alexnet_a100_trace.json.gz")
    assert b.kernels == 79 + 16 + 3
    assert categories_of(kernels, "ampere_sgemm") == {"matmul"}
    assert categories_of(kernels, "sm80_xmma_fprop") == {"matmul"}
    assert categories_of(kernels, "scudnn_128x64_relu") == {"matmul"}  # a conv, not a relu
    assert {c.name: c.kernels for c in b.categories}["matmul"] >= 12


# --------------------------------------------------------------------------- classification


@pytest.mark.parametrize(("name", "category"), [
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >", "attention"),
    ("fmha_cutlassB_f16_aligned_64x64_k64_sm80", "attention"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "matmul"),
    ("ampere_sgemm_128x64_nn", "matmul"),
    ("void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1>", "matmul"),
    ("sm80_xmma_dgrad_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw", "matmul"),
    ("void cudnn::detail::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>", "matmul"),
    ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float>", "embedding"),
    ("void at::native::(anonymous namespace)::indexSelectSmallIndex<float, long>", "embedding"),
    ("void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*)", "embedding"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float> >", "optimizer"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>", "norm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>", "norm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "memory"),
    ("triton_poi_fused_add_cos_sin_0", "elementwise"),
    ("triton_red_fused_gelu_gelu_backward_sum_0", "other"),  # a reduction, despite the gelu
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >", "other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "other"),
    ("void small_reduce_kernel<float>", "other"),  # "all_reduce" inside a word is not NCCL
    ("hadamard_transform_kernel", "other"),  # "adam" inside a word is not Adam
])
def test_default_rules(name, category):
    assert classify(name) == category


def test_kernel_categories_are_the_one_vocabulary():
    """Every rule sorts into `opgraph.core.categories`, the roofline's names and the trace-only
    ones; only the output head cannot be told apart from other matrix multiplies by a kernel's
    name."""
    from opgraph.core import categories
    from opgraph.cost.profile import CATEGORIES

    assert CATEGORIES is categories.CATEGORIES
    assert {category for category, _ in KERNEL_RULES} == set(categories.ALL) - {"output_head"}
    assert set(categories.KERNELS_COVER) == set(categories.ALL) - {"output_head"}
    covered = [c for cover in categories.KERNELS_COVER.values() for c in cover]
    assert sorted(covered) == sorted(CATEGORIES)  # each roofline category measured once


def test_a_prepended_rule_wins(tmp_path):
    rules = (("mine", r"my_fused|sgemm"),) + KERNEL_RULES
    assert classify("my_fused_rope_kernel", rules=rules) == "mine"
    assert classify("ampere_sgemm_128x64_nn", rules=rules) == "mine"
    assert classify("ampere_sgemm_128x64_nn") == "matmul"
    kernels = read_trace(write(tmp_path / "t.json", hand_trace()))
    cats = {c.name: c.kernels for c in breakdown(kernels, rules=(("mine", "gemm"),)).categories}
    assert cats == {"mine": 2, "other": len(HAND_KERNELS) - 2}  # only the given rules apply


def test_load_rules_prepends_to_the_defaults(tmp_path):
    path = write(tmp_path / "rules.json", [{"category": "rope", "pattern": "ROTARY"}])
    rules = load_rules(path)
    assert rules == (("rope", "ROTARY"),) + KERNEL_RULES
    assert classify("apply_rotary_kernel", rules=rules) == "rope"  # case-insensitive
    assert load_rules(path, base=()) == (("rope", "ROTARY"),)


@pytest.mark.parametrize("document", [
    [{"category": "x", "pattern": "(unclosed"}],
    [{"category": "x", "pattern": "a{2,1}\nb"}],
    {"category": "x", "pattern": "y"},
    [{"category": "x"}],
    [{"category": "", "pattern": "y"}],
    [{"category": "x", "regex": "y"}],
    [["x", "y"]],
])
def test_load_rules_rejects_bad_files_in_one_line(tmp_path, document):
    path = write(tmp_path / "rules.json", document)
    with pytest.raises(OpgraphError) as e:
        load_rules(path)
    assert "\n" not in str(e.value) and "rules.json" in str(e.value)


def test_a_bad_pattern_passed_in_code_is_a_one_line_error():
    with pytest.raises(OpgraphError) as e:
        classify("anything", rules=(("x", "(unclosed"),))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- bad input


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    good = gzip.compress(json.dumps(hand_trace()).encode())
    files = {
        "truncated gzip": (tmp_path / "cut.json.gz", good[: len(good) // 2]),
        "corrupt gzip": (tmp_path / "bad.json.gz", good[:10] + b"\0" * 40 + good[50:]),
        "not JSON": (tmp_path / "trace.json", b'{"traceEvents": [\n  {"ph": "X",, }\n]}'),
        "not text": (tmp_path / "binary.json", b"\xff\xfe\x00garbage\x80\x81"),
        "empty file": (tmp_path / "empty.json", b""),
        "no traceEvents": (tmp_path / "object.json", b'{"schemaVersion": 1}'),
        "traceEvents not a list": (tmp_path / "wrong.json", b'{"traceEvents": {"ph": "X"}}'),
        "a number": (tmp_path / "number.json", b"42"),
        "no kernels": (tmp_path / "cpu.json", json.dumps({"traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}).encode()),
        "empty event list": (tmp_path / "none.json", b"[]"),
    }
    for path, data in files.values():
        path.write_bytes(data)
    paths = {what: path for what, (path, _) in files.items()}
    paths["missing file"] = tmp_path / "missing.json.gz"
    paths["a directory"] = tmp_path
    return paths


@pytest.mark.parametrize("what", [
    "truncated gzip", "corrupt gzip", "not JSON", "not text", "empty file", "no traceEvents",
    "traceEvents not a list", "a number", "no kernels", "empty event list", "missing file",
    "a directory",
])
def test_bad_input_is_one_line_opgraph_error(tmp_path, what):
    path = _bad_inputs(tmp_path)[what]
    with pytest.raises(OpgraphError) as e:
        read_trace(path)
    message = str(e.value)
    assert "\n" not in message and message.strip() == message
    assert str(path) in message and ": " in message  # names the file, then says what to do


def test_bad_input_messages_say_what_is_wrong(tmp_path):
    paths = _bad_inputs(tmp_path)

    def message(what):
        with pytest.raises(OpgraphError) as e:
            read_trace(paths[what])
        return str(e.value)

    assert "truncated or corrupt gzip" in message("truncated gzip")
    assert "is not JSON (line 2, column" in message("not JSON")
    assert "export_chrome_trace" in message("not JSON")
    assert '"traceEvents"' in message("no traceEvents")
    assert "no GPU kernels" in message("no kernels") and "ProfilerActivity.CUDA" in message(
        "no kernels")
    assert "does not exist" in message("missing file")


# --------------------------------------------------------------------------- the subcommand


def parse(*argv):
    parser = argparse.ArgumentParser(prog="opgraph")
    trace_breakdown.register(parser.add_subparsers())
    return parser.parse_args(["trace-breakdown", *argv])


def test_cli_json_matches_the_library(tmp_path, capsys):
    path = write(tmp_path / "step.json.gz", hand_trace(), compress=True)
    args = parse(str(path), "--json")
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == breakdown(read_trace(path)).to_json()


def test_cli_table_and_rules_file(tmp_path, capsys):
    path = write(tmp_path / "step.json", hand_trace())
    rules = write(tmp_path / "rules.json", [{"category": "collectives", "pattern": "nccl"}])
    args = parse(str(path), "--rules", str(rules))
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out == format_breakdown(breakdown(read_trace(path), load_rules(rules))) + "\n"
    assert "collectives" in out and "communication" not in out


def test_cli_bad_trace_raises_opgraph_error(tmp_path):
    args = parse(str(tmp_path / "nope.json"))
    with pytest.raises(OpgraphError):
        args.func(args)


def test_main_cli_reports_bad_trace_in_one_line(tmp_path, capsys):
    from opgraph.cli import main

    assert main(["trace-breakdown", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: ") and err.count("\n") == 1


def test_kernel_is_frozen():
    kernel = Kernel("k", 0.0, 1.0, None, None)
    with pytest.raises(AttributeError):
        kernel.name = "other"  # type: ignore[misc]


def test_reading_leaves_the_garbage_collector_as_it_was(tmp_path):
    import gc

    good = write(tmp_path / "t.json", hand_trace())
    bad = write(tmp_path / "cpu.json", {"traceEvents": []})
    assert gc.isenabled()
    read_trace(good)
    with pytest.raises(OpgraphError):
        read_trace(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        read_trace(good)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_odd_events_are_skipped_not_fatal(tmp_path):
    events = hand_trace()["traceEvents"] + [
        {"ph": "X", "cat": ["kernel"], "name": "a list category", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "bool dur", "ts": T0, "dur": True},
        {"ph": "X", "cat": "kernel", "name": "negative dur", "ts": T0, "dur": -3},
    ]
    odd_ids = _complete("odd ids", "kernel", 0, 1, stream="--1", device=2.0)
    kernels = read_trace(write(tmp_path / "odd.json", events + [odd_ids]))
    assert [k.name for k in kernels] == [row[0] for row in HAND_KERNELS] + ["odd ids"]
    assert (kernels[-1].stream, kernels[-1].device) == (None, 2)


def test_a_newline_in_the_file_name_stays_escaped(tmp_path):
    path = write(tmp_path / "two\nlines.json", {"schemaVersion": 1})
    with pytest.raises(OpgraphError) as e:
        read_trace(path)
    assert "\n" not in str(e.value) and "two\\nlines.json" in str(e.value)


def test_rules_given_as_lists_work_and_bad_shapes_are_one_line_errors():
    assert classify("my_fused_rope", rules=[["rope", "rope"]]) == "rope"
    for rules in ([{"category": "x"}], [("x",)], [("x", 3)]):
        with pytest.raises(OpgraphError) as e:
            classify("k", rules=rules)
        assert "\n" not in str(e.value)


def test_main_cli_json_is_the_breakdown(tmp_path, capsys):
    """Through `opgraph.cli.main`, as a user runs it: the JSON is the hand trace's arithmetic."""
    from opgraph.cli import main

    path = write(tmp_path / "step.json.gz", hand_trace(), compress=True)
    assert main(["trace-breakdown", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    busy = (12 - 0) + (25 - 20) + (29 - 26) + (31 - 30)
    assert out["kernels"] == len(HAND_KERNELS)
    assert out["busy_time_s"] == pytest.approx(busy / 1e6, rel=1e-12)
    assert out["idle_time_s"] == pytest.approx((31 - busy) / 1e6, rel=1e-12)
    assert out["span_s"] == pytest.approx(31 / 1e6, rel=1e-12)
    assert {c["name"]: c["kernels"] for c in out["categories"]} == {
        "matmul": 2, "elementwise": 1, "communication": 1, "memory": 2, "norm": 1}
    assert sum(c["time_s"] for c in out["categories"]) == pytest.approx(out["kernel_time_s"])


@pytest.mark.parametrize("content", [b'{"traceEvents": [', b"\x1f\x8b\x08\x00", b'{"a": 1}'])
def test_main_cli_bad_trace_is_exit_2_and_one_line(tmp_path, capsys, content):
    from opgraph.cli import main

    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main(["trace-breakdown", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("opgraph: error: ") and err.count("\n") == 1


def test_breakdown_takes_any_iterable():
    from opgraph.analysis.traces import Kernel, breakdown

    made = (Kernel(f"ampere_sgemm_{i}", 10.0 * i, 5.0, 7, 0) for i in range(3))
    b = breakdown(made)
    assert b.kernels == 3 and b.kernel_time_s == pytest.approx(15e-6)
    assert b.busy_time_s == pytest.approx(15e-6) and b.span_s == pytest.approx(25e-6)
