"""`opgraph plan` as a newcomer runs it: what cannot work fails before the search, in one
line."""

import time

import pytest

from opgraph import search


def _no_search(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the search ran")
    monkeypatch.setattr(search.Searcher, "search", refuse)


def test_a_hopeless_plan_fails_at_once_with_the_reason(cli, monkeypatch):
    """Llama 3.1 405B on 8 H100s: BF16 weights (2 bytes), FP32 gradients (4) and AdamW's FP32
    master weights and two moments (12) are 18 bytes a parameter, 913 GB per GPU even sharded
    over all 8, against 80 GB (H100 SXM datasheet)."""
    _no_search(monkeypatch)
    code, out, _ = cli("profile", "--model", "llama3.1-405b", "--json")
    import json

    parameters = json.loads(out)["parameters"]
    started = time.perf_counter()
    code, out, err = cli("plan", "--model", "llama3.1-405b", "--gpus", "8", "--global-batch", "8")
    assert time.perf_counter() - started < 3
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    per_gpu = 18 * parameters / 8 / 1e9
    assert f"{per_gpu:,.1f} GB per GPU" in err and "weights, gradients and optimizer" in err
    assert f"at least {-(-18 * parameters // 80_000_000_000):,}" in err


def test_the_floor_is_below_every_layout_found(cli):
    """The floor (resident parts over all GPUs) is below what each layout a search returns
    needs: it is a floor, not an estimate."""
    from opgraph import hardware
    from opgraph.commands.plan import _resident_bytes
    from opgraph.models import preset

    forward = preset("llama3.2-1b")
    space = search.Space(gpus=8, batch=16, max_micro_batch=2, precision=("bf16",))
    found = search.Searcher(forward, hardware.get("h100-sxm"), seq_len=2048).search(space, 20)
    floor = _resident_bytes(forward, 2048, space) / 8
    assert found.best and all(r.result.memory.total >= floor for r in found.best)
    assert min(r.result.memory.total for r in found.best) < 4 * floor  # and not far below


def test_a_scaling_curve_skips_the_hopeless_sizes(cli, monkeypatch):
    _no_search(monkeypatch)
    code, _, err = cli("plan", "--model", "llama3.1-405b", "--gpus", "8:16:x2",
                       "--global-batch", "16")
    assert code == 2 and "at any of 8:16:x2 GPUs" in err


@pytest.mark.parametrize("argv, words", [
    (("--model", "gemma2-2b", "--emit", "megatron"), "gemma2-2b is not one"),
    (("--model", "llama3.2-1b", "--emit", "torchtitan"), "llama3.2-1b is not one"),
    (("--model", "gpt2", "--gpus", "8:16:x2", "--rank"), "one --gpus"),
])
def test_options_that_cannot_work_fail_before_the_search(cli, monkeypatch, argv, words):
    _no_search(monkeypatch)
    code, out, err = cli("plan", "--gpus", "8", "--global-batch", "8", *argv)
    assert code == 2 and out == "" and words in err
