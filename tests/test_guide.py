"""docs/writing-a-model.md: its code runs, and it documents every builder method."""

import inspect
import re
from pathlib import Path

import pytest

from opgraph import GraphBuilder

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-model.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)


@pytest.fixture(scope="module")
def namespace():
    ns: dict = {"__name__": "guide"}
    for i, code in enumerate(blocks()):  # our own document's code, run in order
        exec(compile(code, f"{GUIDE.name} block {i + 1}", "exec"), ns)  # noqa: S102
    return ns


def test_the_guides_code_runs(namespace):
    assert len(blocks()) >= 3
    assert namespace["profile"].parameters > 0
    assert namespace["model"].name == "gptj-6b"


def test_the_new_block_is_about_forty_lines():
    first = blocks()[0]
    assert "def parallel_block" in first and len(first.splitlines()) <= 45


def test_every_public_builder_method_is_documented():
    text = GUIDE.read_text()
    methods = [name for name, _ in inspect.getmembers(GraphBuilder, inspect.isfunction)
               if not name.startswith("_")] + ["repeat"]
    missing = [m for m in methods if f"g.{m}(" not in text]
    assert not missing, f"document these in {GUIDE.name}: {missing}"


def test_the_guides_fusion_rules_fuse_across_the_layer_boundary(namespace):
    from opgraph.symbols import B, D, F, L, S

    bought = namespace["bought"]
    added = {o.name for o in bought.added}
    assert {"layers.attn_residual+mlp_norm", "layers.mlp_residual+attn_norm.next",
            "layers.swiglu+down_proj"} <= added
    assert bought.totals_formula("flops") == 0
    # each forward pair stops re-reading a [B, S, D] (or [B, S, F]) BF16 tensor once per layer;
    # the plate's backward, twice the forward, saves twice that again
    saved = 3 * 2 * B * S * L * (2 * D + F)
    assert (bought.totals_formula("bytes") + saved).expand() == 0
