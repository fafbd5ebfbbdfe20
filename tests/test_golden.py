"""Golden files: the compiled step's textual form and `profile --json --ops` of four presets,
checked in before the core was rebuilt, and of four many-GPU jobs (tensor, pipeline and data
parallel with ZeRO-1; a mixture of experts with expert parallelism; the calibrated cost model;
FP8), checked in before the lowered step's defects (issue 21) were fixed. A difference is either
a bug or a decision; a decision is made by `python tests/golden/regenerate.py` in a commit of
its own that says why."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("golden_regenerate", HERE / "regenerate.py")
regenerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regenerate)


def _same(name: str, got: str) -> None:
    want = (HERE / name).read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"golden/{name}", "now", n=1))
        pytest.fail(f"{name} differs from its golden file:\n{diff[:4000]}")


@pytest.mark.parametrize("case", sorted(regenerate.CASES))
def test_step_text_is_golden(case):
    _same(f"{case}.step.txt", regenerate.step_text(regenerate.CASES[case]))


@pytest.mark.parametrize("case", sorted(regenerate.CASES))
def test_profile_json_is_golden(case):
    _same(f"{case}.profile.json", regenerate.profile_json(regenerate.CASES[case]))
