"""`opgraph plan` keeps the structures it compiled for the next run of the same context
(`opgraph.parallel.search.cache`): a warm run reads them all back and answers exactly as a
cold one; anything that decides a structure names another file; a file that is broken, or that
someone else may write, is not read; a folder that cannot be written stops nothing."""

from __future__ import annotations

import json
import os

import attrs
import pytest

from opgraph import hardware
from opgraph.cost.costmodel import cost_model
from opgraph.models import preset
from opgraph.parallel.search import cache

PLAN = ("plan", "--model", "llama3.2-1b", "--gpus", "8", "--global-batch", "8", "--top", "3",
        "--json")


def _plan(cli, monkeypatch, folder, *extra) -> dict:
    monkeypatch.setenv(cache.ENV, str(folder))
    code, out, err = cli(*PLAN, *extra)
    assert code == 0, err
    return json.loads(out)


def _answer(found: dict) -> dict:
    """What the search answers, without its timings and counts of work."""
    return {k: v for k, v in found.items()
            if k not in ("compile_s", "evaluate_s", "layouts_per_s", "compiled", "read")}


def test_a_warm_plan_reads_every_structure_back_and_answers_as_a_cold_one(
        cli, monkeypatch, tmp_path):
    cold = _plan(cli, monkeypatch, tmp_path)
    assert cold["read"] == 0 and cold["compiled"] > 0
    files = list(tmp_path.glob(f"*{cache.SUFFIX}"))
    assert len(files) == 1
    assert files[0].stat().st_mode & 0o077 == 0 and tmp_path.stat().st_mode & 0o022 == 0
    warm = _plan(cli, monkeypatch, tmp_path)
    assert warm["compiled"] == 0 and warm["read"] == cold["compiled"]
    assert _answer(warm) == _answer(cold)
    uncached = _plan(cli, monkeypatch, "off")
    assert _answer(uncached) == _answer(cold) and uncached["read"] == 0


def test_a_plan_run_from_anywhere_keeps_and_reads_its_structures(tmp_path):
    """The whole process, from a folder that is not the checkout (the code digest finds the
    installed packages, not the checkout's folders)."""
    import subprocess
    import sys

    env = {**os.environ, cache.ENV: str(tmp_path / "cache")}
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "opgraph", *PLAN], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert outputs[0]["read"] == 0 and outputs[1]["compiled"] == 0
    assert _answer(outputs[0]) == _answer(outputs[1])


def test_no_cache_neither_reads_nor_writes(cli, monkeypatch, tmp_path):
    found = _plan(cli, monkeypatch, tmp_path, "--no-cache")
    assert found["read"] == 0 and not any(tmp_path.iterdir())


def test_whatever_decides_a_structure_names_another_file(monkeypatch):
    """The context digest moves with the code, the model's dimensions, the sequence length,
    the part, the cost model's efficiencies and the layers pipeline stages split."""
    forward, part = preset("llama3.2-1b"), hardware.get("h100-sxm")
    cost = cost_model("calibrated")
    base = cache.context(forward, part, cost, {"S": 8192}, 16)
    assert cache.context(forward, part, cost, {"S": 8192}, 16) == base  # deterministic
    smaller = forward.copy()
    smaller.dims = {**forward.dims, next(s for s in forward.dims if s.name == "D"): 1024}
    table = dict(cost.table)
    table["hopper"] = attrs.evolve(table["hopper"], matmul=table["hopper"].matmul * 0.99)
    changed = [
        cache.context(smaller, part, cost, {"S": 8192}, 16),
        cache.context(forward, part, cost, {"S": 4096}, 16),
        cache.context(forward, hardware.get("h200"), cost, {"S": 8192}, 16),
        cache.context(forward, part, attrs.evolve(cost, table=table), {"S": 8192}, 16),
        cache.context(forward, part, cost_model("roofline"), {"S": 8192}, 16),
        cache.context(forward, part, cost, {"S": 8192}, 8),
    ]
    monkeypatch.setattr(cache, "fingerprint", lambda: "another version of the code")
    changed.append(cache.context(forward, part, cost, {"S": 8192}, 16))
    assert base not in changed and len(set(changed)) == len(changed)


def test_the_code_digest_reads_every_source_file(tmp_path):
    """A digest of a package's files (`files_digest`, which `fingerprint` takes of opgraph,
    passes and models): a source or data file's bytes and name are in it, bytecode is not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "data.toml").write_text("k = 2\n")
    first = cache.files_digest(tmp_path)
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert cache.files_digest(tmp_path) == first
    (tmp_path / "pkg" / "data.toml").write_text("k = 3\n")
    assert cache.files_digest(tmp_path) != first
    (tmp_path / "pkg" / "data.toml").write_text("k = 2\n")
    assert cache.files_digest(tmp_path) == first
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert cache.files_digest(tmp_path) != first


def test_a_broken_file_is_a_miss_and_is_written_again(cli, monkeypatch, tmp_path):
    cold = _plan(cli, monkeypatch, tmp_path)
    (path,) = tmp_path.glob(f"*{cache.SUFFIX}")
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:size // 3])  # cut short
    again = _plan(cli, monkeypatch, tmp_path)
    assert again["read"] == 0 and _answer(again) == _answer(cold)
    assert path.stat().st_size == size
    path.write_bytes(b"not a pickle")
    assert _plan(cli, monkeypatch, tmp_path)["read"] == 0


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids to compare here")
def test_a_file_someone_else_may_write_is_not_read(cli, monkeypatch, tmp_path):
    _plan(cli, monkeypatch, tmp_path)
    (path,) = tmp_path.glob(f"*{cache.SUFFIX}")
    path.chmod(0o620)  # the group may write it
    assert _plan(cli, monkeypatch, tmp_path)["read"] == 0  # read nothing, wrote it anew
    tmp_path.chmod(0o770)  # the folder's group may write in it
    try:
        found = _plan(cli, monkeypatch, tmp_path)
        assert found["read"] == 0
    finally:
        tmp_path.chmod(0o700)


def test_a_folder_that_cannot_be_written_stops_nothing(cli, monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    found = _plan(cli, monkeypatch, blocker / "cache")  # a folder inside a file: no
    assert found["read"] == 0 and found["layouts"]


def test_a_stage_graph_made_again_must_match_the_cached_formulas(tmp_path):
    """A structure read back holds no graphs (`Searcher.save` leaves them out); an exact
    schedule makes its stage's graph again, and where that graph's ops are not the ones the
    cached formulas name, nothing is scheduled on the mismatch: the file is removed and the
    search stops, saying so in one line."""
    from opgraph.core.errors import OpgraphError
    from opgraph.parallel.search import Searcher, Space, rows, structure

    forward, part = preset("llama3.2-1b"), hardware.get("h100-sxm")
    cold = Searcher(forward, part, cache=tmp_path)
    cold.search(Space(gpus=8, batch=8, tp=2, pp=2), 1)
    assert cold.save()
    warm = Searcher(forward, part, cache=tmp_path)
    r = next(r for r in rows(forward, part, Space(gpus=8, batch=8, tp=2, pp=2), warm.seq,
                             warm.cluster) if structure(r) in cold.structures)
    s = warm.structure(r)
    assert warm.read and not warm.compiled
    roles = list(s.stages)
    assert all(f.graph is None for f in s.stages.values())
    made = warm.stage_graph(s, r, roles[0])
    assert tuple(op.name for op in made.ops()) == s.stages[roles[0]].names
    names = s.stages[roles[-1]].names
    wrong = attrs.evolve(s, stages={**s.stages, roles[-1]: attrs.evolve(
        s.stages[roles[-1]], names=names[::-1])})
    assert list(tmp_path.glob(f"*{cache.SUFFIX}"))
    with pytest.raises(OpgraphError, match="does not match the structures"):
        warm.stage_graph(wrong, r, roles[-1])
    assert not list(tmp_path.glob(f"*{cache.SUFFIX}")) and structure(r) == s.key


def test_the_layouts_that_fit_are_counted_once_for_every_run(tmp_path):
    """`fitting` compiles a structure no search needed for its count alone, and keeps the
    count: a second run of the same context counts the same from the file, compiling
    nothing."""
    from opgraph.parallel.search import Searcher, Space

    forward, part = preset("llama3.2-1b"), hardware.get("h100-sxm")
    space = Space(gpus=8, batch=8, max_pp=2, max_micro_batch=2)
    cold = Searcher(forward, part, cache=tmp_path)
    fit = cold.fitting(space)
    assert cold.compiled and cold.fit_counts and cold.save()
    warm = Searcher(forward, part, cache=tmp_path)
    assert warm.fitting(space) == fit
    assert warm.compiled == 0 and not warm.structures
    assert Searcher(forward, part).fitting(space) == fit  # and as one without a cache counts


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    assert cache.folder() == tmp_path
    for off in ("off", "", "OFF", "none", "0"):
        monkeypatch.setenv(cache.ENV, off)
        assert cache.folder() is None
    monkeypatch.delenv(cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.folder() == tmp_path / "xdg" / "opgraph"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.folder() == tmp_path / "home" / ".cache" / "opgraph"
