"""The plate's figures (PLATE.md), through the whole pipeline: model graph, passes, evaluate."""

import pytest
from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    return preset("llama3-8b")


def profile(forward, fused=True, **values):
    return evaluate(compile_step(forward, fused_attention=fused, check=True), H100, values)


def test_fused_one_sequence(llama):
    p = profile(llama)
    assert p.tokens == 8192
    assert p.step_time_s == pytest.approx(0.556, rel=0.01)
    assert p.category("matmul").time_share == pytest.approx(0.62, abs=0.01)
    opt = p.category("optimizer")
    assert opt.time_share == pytest.approx(0.15, abs=0.005)
    assert 0.00020 <= opt.flop_share <= 0.00024
    assert p.mfu_ceiling == pytest.approx(0.67, abs=0.01)


def test_unfused_one_sequence(llama):
    p = profile(llama, fused=False)
    assert p.category("attention").time_share == pytest.approx(0.34, abs=0.01)
    assert p.mfu_ceiling == pytest.approx(0.50, abs=0.01)


def test_eight_sequences(llama):
    p = profile(llama, B=8)
    assert p.tokens == 65536
    assert p.category("optimizer").time_share == pytest.approx(0.02, abs=0.005)
