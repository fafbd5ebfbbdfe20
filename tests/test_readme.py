"""The README and the pages under docs/ are the program's own words: every `$ opgraph ...`
example prints what the page shows, the README's Python example prints what it says, every link
to a file in the repository leads somewhere, and no page tells the project's history (commit
messages keep it)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The parser and runner docs/regenerate.py rewrites the pages with: one reading of a page.
_spec = importlib.util.spec_from_file_location("regenerate", ROOT / "docs" / "regenerate.py")
regenerate = importlib.util.module_from_spec(_spec)
sys.modules["regenerate"] = regenerate
_spec.loader.exec_module(regenerate)

PAGES = regenerate.pages()
EXAMPLES = [ex for page in PAGES for ex in regenerate.examples(page)]


def test_the_in_python_example_prints_what_it_says():
    example = regenerate.python_example(README.read_text())
    assert "import" in example["code"] and example["printed"]
    assert regenerate.run_python(example["code"]) == example["printed"]


STDERR = [(page, m, command) for page in PAGES for m, command in regenerate.stderr_blocks(page)]


@pytest.mark.parametrize("page, block, command", STDERR,
                         ids=[f"{p.name}: {c}" for p, _, c in STDERR])
def test_every_stderr_block_is_what_its_command_warns(page, block, command):
    """A block introduced as what goes to stderr is the stderr of the page's command above it
    (the README's and profile.md's warning that the plate's step needs more than 80 GB)."""
    code, _, err = regenerate.run(regenerate.argv(command))
    assert code == 0 and err == block["shown"]


def test_the_stderr_blocks_are_found():
    assert {(p.name, c) for p, _, c in STDERR} >= {("README.md", "opgraph profile"),
                                                    ("profile.md", "opgraph profile")}


def test_every_page_shows_examples():
    """The parser finds the examples: the README's tour and each topic page with a command."""
    per_page = {p.name: sum(ex.page == p for ex in EXAMPLES) for p in PAGES}
    assert per_page["README.md"] >= 5
    for name in ("profile.md", "formulas.md", "models.md", "fusion-and-diff.md", "memory.md",
                 "many-gpus.md", "calibration.md", "planning.md", "traces.md"):
        assert per_page[name] >= 1, name


@pytest.mark.parametrize("example", EXAMPLES, ids=[ex.name for ex in EXAMPLES])
def test_every_example_prints_what_its_page_shows(example):
    """A block with a `...` line shows an excerpt: its other lines must each appear in what the
    command prints. Any other block is the command's whole stdout. Each command runs from a
    scratch folder, so a path a page shows works from any folder; commands that several pages
    show run once."""
    if example.needs_shared and not regenerate.SHARED.is_dir():
        pytest.skip("reads ../shared's real traces; ../shared is not beside the repo")
    code, out, err = regenerate.run(regenerate.argv(example.command))
    assert code == 0, err
    if example.excerpt:
        missing = regenerate.missing(example, out, err)
        assert not missing, f"{example.command}: not printed: {missing}"
    else:
        assert out.rstrip("\n") == example.shown


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_regenerating_what_a_page_shows_gives_the_page_back(page):
    """docs/regenerate.py rewrites a block from its commands' outputs: given the outputs the
    page shows, it writes the page back byte for byte (blank lines, fences, neighbours)."""
    shown = {(ex.block, ex.command): ex.shown for ex in regenerate.examples(page)}
    assert regenerate._rewrite(page, shown) == page.read_text()


def test_regenerating_changes_only_the_output():
    """A changed output replaces that command's lines and nothing else."""
    page = ROOT / "docs" / "formulas.md"
    first = regenerate.examples(page)[0]
    text = regenerate._rewrite(page, {(first.block, first.command): "new output"})
    assert text.replace(f"$ {first.command}\nnew output", f"$ {first.command}\n{first.shown}",
                        1) == page.read_text()


RECORDED = [r for page in PAGES for r in regenerate.recorded(page)]


def test_the_recorded_blocks_are_found():
    """planning.md's searches and the leave-one-family-out refit, too slow for the suite, are
    recorded blocks, each with its command; `python3 docs/regenerate.py --check --slow` reruns
    them."""
    commands = {r.command for r in RECORDED if r.page.name == "planning.md"}
    assert len(commands) == 7
    assert ("opgraph plan --model llama3.1-405b --gpus 8192 --tokens 16777216 --tp 8 --pp 16 "
            "--cp 1 --precision bf16 --rank --top 3") in commands
    refit = {r.page.name for r in RECORDED if r.command == "opgraph validate --cv family"}
    assert refit == {"README.md", "calibration.md"}
    for record in RECORDED:
        regenerate.argv(record.command)  # an opgraph command, its words split as a shell would
        assert record.shown and not record.shown.startswith("$ ")


@pytest.mark.parametrize("page", sorted({r.page for r in RECORDED}), ids=lambda p: p.name)
def test_rewriting_a_recorded_block_with_what_it_shows_gives_the_page_back(page):
    text = page.read_text()
    for record in regenerate.recorded(page):
        assert regenerate._rewrite_recorded(page, record, record.shown) == text


def test_a_searchs_timing_is_masked_and_nothing_else():
    """What varies from run to run is masked; the counts beside it are compared."""
    line = ("searched 26,928 layouts over 256 structures, 39 of them evaluated (3,038 of their "
            "layouts fit in memory, 6 scheduled exactly); compiled in {} s, evaluated in {} s "
            "({} layouts/s)")
    assert (regenerate.masked(line.format("1.47", "1.09", "24,812"))
            == regenerate.masked(line.format("12.30", "0.90", "987"))
            == line.format("#", "#", "#"))
    assert regenerate.masked("  1  tp2 cp8 pp32(3/.../3) dp16 mb1 v4    12.177        168") == (
        "  1  tp2 cp8 pp32(3/.../3) dp16 mb1 v4    12.177        168")


def test_the_readme_is_a_front_door():
    """A newcomer reads it through: a few hundred lines, Python's version, the two commands as
    .ci/run runs them, and a link to every topic page."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "Python 3.11" in text
    assert "pip install . && opgraph profile" in text
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "python3 -m pip install -q -e '.[test]' && python3 -m pytest -q"
    assert test_command in text and test_command in ci
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in text, page.name


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_to_a_file_leads_somewhere(page):
    links = [m.group(1) for m in LINK.finditer(page.read_text())]
    broken = [ln for ln in links if "://" not in ln and not (page.parent / ln).exists()]
    assert not broken


# Words that tell how the project got here rather than what it does ("the issue asked for",
# "no longer", "now", "still to come", timings "before" a change). Whole words and phrases, so
# "known", "before the backward" or "fused to" do not match; a page says what is true today,
# and the commit messages keep how it came to be.
HISTORY = (
    r"the issue\b", r"\bissue #?\d", r"\bissues? (asked|said|wanted)", r"\bused to\b",
    r"\bbefore this\b", r"\bno longer\b", r"\bnow\b", r"\bpreviously\b", r"\bstill to come\b",
    r"\bto come\b", r"\bfor now\b", r"\bearlier versions?\b", r"\bversion of the code\b",
    r"\bwas rebuilt\b", r"\bwere rebuilt\b", r"\bhas been (added|removed|changed|fixed)\b",
    r"\bwe (added|changed|fixed|removed)\b", r"\bpull request\b", r"\bthis PR\b",
    r"\bmisses by\b", r"\bbefore it (counted|was)\b", r"\bit took\b", r"\bTODO\b",
    # a fit's or an error's move after a change: "the share rose from 0.650 to 0.667"
    r"\b(went|rose|fell) from\b", r"\bmoved the (fitted|shared) share\b",
)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_page_tells_the_projects_history(page):
    hits = [(n, m.group(0)) for n, line in enumerate(page.read_text().splitlines(), 1)
            for pattern in HISTORY for m in re.finditer(pattern, line, re.IGNORECASE)]
    assert not hits, f"{page.name}: development history (line, words): {hits}"


def test_the_history_check_catches_history():
    """The patterns above are live: each sentence below (from earlier pages) is caught."""
    told = ["The issue asked for 6 x 6,979,588,096 x tokens",
            "profile no longer imports numpy at start-up",
            "a calibrated cost model, still to come, is where they belong",
            "The bound now takes the longest path",
            "(c) is met; (a) misses by about 80 x",
            "It took 105 s while the bound counted only a collective",
            "With them the fitted share rose from 0.650 to 0.667",
            "SimuMax's family went from 6.9% to 5.5% in-sample"]
    for sentence in told:
        assert any(re.search(p, sentence, re.IGNORECASE) for p in HISTORY), sentence
