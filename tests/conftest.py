import gc
import os
import sys
from pathlib import Path

import pytest

# sympy memoises its constructors and simplifications in LRU caches of SYMPY_CACHE_SIZE entries
# each (default 1,000), read once when sympy is first imported. One process compiles every
# preset's steps, searches and formulas, and evicts what the next test asks for again: with
# 20,000 the same subsets take 16-30% less CPU (tests/test_search.py 46.7 -> 39.1 s,
# test_formula + test_solve + test_agreement 26.1 -> 18.2 s; 100,000 does no better) and no
# more memory (960 -> 964 MB peak). The cache changes no result, only how often one is made.
if "sympy" not in sys.modules:  # pytest loads this file before any test module imports it
    os.environ.setdefault("SYMPY_CACHE_SIZE", "20000")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

# `opgraph plan` keeps compiled structures for the next run in the user's cache folder
# (`opgraph.parallel.search.cache`); the suite writes nowhere outside its temporary folders,
# and a test of the cache names its own folder.
os.environ["OPGRAPH_CACHE_DIR"] = "off"

# The suite runs in one process whose heap only grows: sympy's caches, each module's compiled
# steps and searchers, the published runs compiled once a process. CPython rescans all of it in
# a full collection each time the long-lived objects grow by a quarter, 30 times over
# test_search.py and test_calibration.py at 0.4-0.9 s each: 12.6 of their 62 s of CPU. A full
# collection after 1,000 middle-generation ones (CPython's default: 10) leaves the young
# collections, which free a test's short-lived cycles, as they are; the peak memory of those two
# files rises from 0.8 to 1.0 GB (issue #24).
young, middle, _ = gc.get_threshold()
gc.set_threshold(young, middle, 1000)


def pytest_unconfigure(config):
    """After the last test pytest collects five times over (its unraisable-exception plugin's
    cleanup, which runs next: a finalizer can free more garbage), each a rescan of the whole
    heap, about a second apiece at the suite's end. Collect once here, with its hook still
    recording what a finalizer raises, and freeze what survives: those five then scan only
    what was made since."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def shared() -> Path:
    """`../shared` beside the repo, with the real traces and the raw records of the published
    runs; the tests that read them skip, saying so, where it is absent."""
    if not SHARED.is_dir():
        pytest.skip("reads ../shared's real traces or raw records; ../shared is not beside the "
                    "repo")
    return SHARED


@pytest.fixture
def cli(capsys):
    """Run the CLI in process: `code, out, err = cli("profile", "--json")`."""
    from opgraph.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def pytest_terminal_summary(terminalreporter):
    """Say why each test skipped, grouped by reason, even without `-rs`: on a fresh clone the
    only skips are tests that read ../shared's real traces and records."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in terminalreporter.reportchars.lower():
        return
    reasons: dict[str, list[str]] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        reasons.setdefault(reason.removeprefix("Skipped: "), []).append(report.nodeid)
    terminalreporter.section("skipped, and why")
    for reason, nodeids in sorted(reasons.items()):
        terminalreporter.line(f"{len(nodeids)} skipped: {reason}")
        for nodeid in nodeids:
            terminalreporter.line(f"    {nodeid}")
