"""The trace reader against inputs built to hurt it: catastrophic regular expressions, endless
and inflating files, integers too long to convert, times that overflow, and JSON cut at every
place a chunk can end. Each bad input is one line on stderr, exit status 2, nothing on stdout."""

import gzip
import json
import random
import re
import sys
import time
import tracemalloc

import pytest

from opgraph.core.errors import OpgraphError
from opgraph.analysis.traces import (KERNEL_RULES, Kernel, breakdown, classify, iter_kernels,
                                     load_rules, read_trace, source)
from opgraph.analysis.traces.jsonstream import trace_events
from opgraph.analysis.traces.rules import MAX_NAME_CHARS, pattern_cost

T0 = 1_700_000_000_000_000


def kernel_event(name="ampere_sgemm_128x64_nn", ts=T0, dur=10, **extra):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": 7, "device": 0}, **extra}


def fails_cleanly(cli, *argv) -> str:
    """Run the CLI; assert the opgraph way of failing; return the one error line."""
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert err.startswith("opgraph: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# --------------------------------------------------------------------------- regular expressions


def test_every_built_in_rule_is_at_most_quadratic():
    for category, pattern in KERNEL_RULES:
        assert pattern_cost(pattern) <= 2, category


@pytest.mark.parametrize("pattern", [
    "(a+)+$",  # the fuzzer's: exponential on "aaa...a!"
    r"(a|aa)*b",  # a repeated alternation whose branches overlap
    r"triton_(?:red|per)_fused\w*mean\w*rsqrt",  # the old norm rule: cubic when searched
    r"a.*b.*c",
    r"(x)\1",
])
def test_costly_patterns_are_rejected_before_they_run(tmp_path, cli, pattern):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"category": "mine", "pattern": pattern}]))
    with pytest.raises(ValueError):
        pattern_cost(pattern)
    with pytest.raises(OpgraphError, match="cannot be used"):
        load_rules(rules)
    with pytest.raises(OpgraphError, match="cannot be used"):
        classify("a" * 35, rules=(("mine", pattern),))
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([kernel_event("a" * 35)]))
    assert "cannot be used" in fails_cleanly(cli, "trace-breakdown", str(trace), "--rules",
                                             str(rules))


def test_rules_see_a_bounded_prefix_of_a_name():
    tail = "x" * 10 * MAX_NAME_CHARS
    assert classify("ampere_sgemm_128x64_nn" + tail) == "matmul"
    assert classify("y" * MAX_NAME_CHARS + "ampere_sgemm") == "other"  # past what rules see


def test_hostile_names_against_the_built_in_rules_finish():
    """Names made of each rule's own prefixes, repeated (the worst case of a backtracking
    search), far longer than any kernel's. Each costs at most MAX_NAME_CHARS ** 2 steps a rule,
    milliseconds; the limit is a hundred times what that takes, so it cannot flake."""
    names = ["triton_red_fused" + "_mean" * 5000, "triton_red_fused_" + "mean" * 5000 + "rsqr",
             "miopen" * 5000, "triton_tem" * 5000, "s" + "1" * 50000, "a" * 100_000 + "!"]
    start = time.process_time()
    for name in names:
        classify(name + "_unique_to_this_test")
    assert time.process_time() - start < 10


# --------------------------------------------------------------------------- endless and inflating


def test_dev_zero_is_one_line(cli):
    err = fails_cleanly(cli, "trace-breakdown", "/dev/zero")
    assert "/dev/zero is not JSON (line 1, column 1" in err


def test_a_gzip_bomb_stops_at_the_cap(tmp_path, cli):
    """A valid start, then spaces that inflate a thousand-fold: reading stops at the cap and the
    message names it and the option that raises it."""
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * 3_000_000 + b"]}"))
    assert bomb.stat().st_size < 10_000
    err = fails_cleanly(cli, "trace-breakdown", str(bomb), "--max-trace-gb", "0.001")
    assert "more than 1,000,000 bytes once decompressed" in err and "--max-trace-gb" in err
    with pytest.raises(OpgraphError, match="more than 1,000 bytes"):
        list(iter_kernels(bomb, max_bytes=1000))
    fails_cleanly(cli, "compare", str(bomb), "--max-trace-gb", "0.001")


def test_the_cap_stops_reading(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b" " * 5000 + b"]")
    with pytest.raises(OpgraphError, match="more than 100 bytes"):
        b"".join(source.read_chunks(big, "trace", 100, "x"))


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e400", "many"])
def test_a_bad_cap_is_refused(tmp_path, cli, value):
    fails_cleanly(cli, "trace-breakdown", str(tmp_path / "t.json"), "--max-trace-gb", value)


def test_a_rules_file_from_dev_zero_is_one_line(tmp_path, cli):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([kernel_event()]))
    fails_cleanly(cli, "trace-breakdown", str(trace), "--rules", "/dev/zero")


def test_memory_stays_bounded_while_reading(tmp_path):
    """4,000 kernels padded to 12 MB of JSON: the reader holds a chunk or two, not the file."""
    events = [kernel_event(f"ampere_sgemm_{i % 50}", T0 + 20 * i, 10,
                           padding="p" * 3000) for i in range(4_000)]
    path = tmp_path / "big.json.gz"
    text = json.dumps({"traceEvents": events}).encode()
    path.write_bytes(gzip.compress(text, 1))
    del events
    tracemalloc.start()
    try:
        b = breakdown(iter_kernels(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert b.kernels == 4_000 and b.kernel_time_s == pytest.approx(4_000 * 10e-6)
    assert len(text) > 12_000_000 and peak < 8 * source.CHUNK  # chunks, not the 12+ MB file


# --------------------------------------------------------------------------- numbers


def test_an_integer_too_long_in_ts_is_one_line(tmp_path, cli):
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": '
                    + "9" * 5000 + ', "dur": 1}]}')
    err = fails_cleanly(cli, "trace-breakdown", str(path), "--json")
    assert "integer too long" in err and f"{sys.get_int_max_str_digits():,} digits" in err


def test_an_integer_too_long_in_a_rules_file_is_one_line(tmp_path, cli):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([kernel_event()]))
    rules = tmp_path / "rules.json"
    rules.write_text('[{"category": "x", "pattern": ' + "1" * 5000 + "}]")
    assert "integer too long" in fails_cleanly(cli, "trace-breakdown", str(trace), "--rules",
                                               str(rules))


@pytest.mark.parametrize(("ts", "dur"), [
    (1e308, 1e308),  # ts + dur overflows
    (-1.7e308, 10), (1.7e308, 10),  # the span overflows
    (10**400, 1),  # an integer no float holds
    (T0, 1e300),
])
def test_times_beyond_any_clock_are_errors(tmp_path, cli, ts, dur):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([kernel_event(ts=T0), kernel_event(ts=ts, dur=dur)]))
    assert "which no clock gives" in fails_cleanly(cli, "trace-breakdown", str(path), "--json")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_errors(tmp_path, cli, literal):
    path = tmp_path / "t.json"
    path.write_text('[{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": ' + literal + "}]")
    fails_cleanly(cli, "trace-breakdown", str(path), "--json")


def test_json_output_is_strict_json(tmp_path, cli):
    """The largest times accepted still give finite figures: the output parses without NaN or
    Infinity."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps([kernel_event(ts=-9.9e17, dur=9.9e17),
                                kernel_event(ts=9.9e17, dur=9.9e17)]))
    code, out, _ = cli("trace-breakdown", str(path), "--json")
    assert code == 0

    def refuse(constant):
        raise AssertionError(constant)

    result = json.loads(out, parse_constant=refuse)
    assert result["span_s"] == pytest.approx((9.9e17 + 9.9e17 + 9.9e17) / 1e6)


def test_compare_refuses_more_steps_than_kernels(tmp_path, cli):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([kernel_event()]))
    assert "--steps" in fails_cleanly(cli, "compare", str(path), "--steps", "2")
    assert "--steps" in fails_cleanly(cli, "compare", str(path), "--steps", str(10**400))


# --------------------------------------------------------------------------- the tokenizer


def _random_value(rng, depth=0):
    pick = rng.random()
    if depth > 3 or pick < 0.4:
        return rng.choice([0, -7, 2.5e-3, 1.5e300, 12345678901234567890, True, False, None, "",
                           'q"uo\\te\n', "é€𝄞", "\\u00e9"])
    if pick < 0.7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64])
def test_events_read_across_any_chunk_boundary_equal_json_loads(tmp_path, monkeypatch, chunk):
    """Every place a chunk can end (inside a string, an escape, a number, a UTF-8 sequence):
    the events read one at a time are those `json.loads` finds."""
    monkeypatch.setattr(source, "CHUNK", chunk)
    rng = random.Random(chunk)
    path = tmp_path / "t.json"
    for case in range(12):
        events = [_random_value(rng) for _ in range(rng.randint(0, 5))]
        document = {"before": _random_value(rng), "traceEvents": events} if case % 2 else events
        text = json.dumps(document, indent=rng.choice([None, 2]), ensure_ascii=case % 3 == 0)
        data = text.encode(["utf-8", "utf-16", "utf-8-sig"][case % 3])
        path.write_bytes(gzip.compress(data) if case % 4 == 0 else data)
        assert list(trace_events(path)) == json.loads(data.decode(["utf-8", "utf-16",
                                                                   "utf-8-sig"][case % 3]))[
            "traceEvents" if case % 2 else slice(None)], text


@pytest.mark.parametrize(("text", "message"), [
    ('{"traceEvents": [1,]}', "trailing comma"),
    ('{"traceEvents": [1 2]}', "Expecting ',' delimiter"),
    ('{"traceEvents": [1]} x', "Extra data"),
    ('{"traceEvents": [1], "a" 2}', "Expecting ':' delimiter"),
    ('[1, 2', "Expecting ',' delimiter"),
    ('[' * 100_000, "nested too deeply"),
], ids=["trailing comma", "no comma", "extra data", "no colon", "cut", "deep"])
def test_malformed_documents_are_one_line_errors(tmp_path, monkeypatch, text, message):
    for chunk in (3, 1 << 20):
        monkeypatch.setattr(source, "CHUNK", chunk)
        path = tmp_path / "t.json"
        path.write_text(text)
        with pytest.raises(OpgraphError, match=re.escape(message)) as e:
            list(trace_events(path))
        assert "\n" not in str(e.value)


def test_kernel_rows_stream_lazily(tmp_path):
    """The first kernel comes out before the file's end is read: a file cut after it still
    yields it, then fails."""
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [' + json.dumps(kernel_event()) + ", " + " " * 100)
    kernels = iter_kernels(path)
    assert next(kernels) == Kernel("ampere_sgemm_128x64_nn", T0, 10.0, 7, 0)
    with pytest.raises(OpgraphError, match="not JSON"):
        next(kernels)


def test_an_empty_path_is_one_line(cli, tmp_path):
    assert "empty" in fails_cleanly(cli, "trace-breakdown", "")  # the CLI's own check, first
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([kernel_event()]))
    assert "empty" in fails_cleanly(cli, "trace-breakdown", str(trace), "--rules", " ")


def test_the_library_refuses_an_empty_path_too():
    with pytest.raises(OpgraphError, match="trace path is empty"):
        read_trace("")
