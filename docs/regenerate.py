"""Rerun every `$ opgraph ...` example of README.md and docs/*.md and rewrite what it shows.

    python3 docs/regenerate.py            # rewrite every full output, report stale excerpts
    python3 docs/regenerate.py --check    # rewrite nothing; exit status 1 if anything is stale

An example is a fenced block whose first line is `$ opgraph ...`; a block may hold several,
each `$` line followed by what that command prints on stdout. A block introduced by "on
stderr ...:" shows what the page's previous command prints on stderr. The README's Python
example is rerun and what it prints rewritten too. A block with a `...` line shows an excerpt:
it is never rewritten, and each of its other lines that the command does not print (stdout and
stderr together) is reported, for a person to choose the new excerpt. Commands run
in process, from a scratch folder (every path a page shows must work from any folder); a
command that names `../shared` reads the folder beside the repository, and is left alone, with
a note, where that folder is absent. tests/test_readme.py checks the pages with the same parser
and runner.

A recorded output is a fenced block whose command is too slow for the tests, named in an HTML
comment on the line before its fence: `<!-- recorded: opgraph ... -->`, or `<!-- recorded
(slow): opgraph ... -->` for one that takes more than a few seconds (a search, a refit). It is
rerun, compared and rewritten as an example is (a `...` line makes it an excerpt), with what
varies from run to run masked: a search's "compiled in 1.47 s, evaluated in 1.09 s (24,812
layouts/s)". The slow ones run only under --slow; on 2 cores:

    python3 docs/regenerate.py --check          # about 20 s
    python3 docs/regenerate.py --check --slow   # and the slow ones: about 4 minutes, 2 of
                                                # them `opgraph validate --cv family`
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

# a page shows what a first run prints: no structures read from a cache of an earlier one
# (`opgraph.parallel.search.cache`)
os.environ["OPGRAPH_CACHE_DIR"] = "off"

import attrs

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FENCE = re.compile(r"^```")


def pages() -> list[Path]:
    """README.md, then every page under docs/, in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@attrs.frozen
class Example:
    """One `$ opgraph ...` line of a page and the output shown under it."""

    page: Path
    command: str  # after the `$ `: `opgraph profile --tokens 65536`
    shown: str  # the lines under it, up to the next `$` line or the block's end
    block: int  # which example block of the page (0, 1, ...)

    @property
    def excerpt(self) -> bool:
        return "..." in self.shown.splitlines()

    @property
    def needs_shared(self) -> bool:
        return "../shared" in self.command

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}: {self.command}"


@attrs.frozen
class Recorded(Example):
    """A block recorded from the command named in the comment on the line before its fence;
    `block` is the index of its first line in the page."""

    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}: recorded {self.command}"


RECORDED = re.compile(r"^<!-- recorded(?P<slow> \(slow\))?: (?P<command>opgraph .*) -->$")


def recorded(page: Path) -> list[Recorded]:
    """Every recorded block of one page, in order."""
    lines = page.read_text().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = RECORDED.match(line)
        if m is None:
            continue
        if not FENCE.match(lines[i + 1]):
            raise ValueError(f"{page.name}:{i + 1}: no fenced block right after {line}")
        end = next(j for j in range(i + 2, len(lines)) if FENCE.match(lines[j]))
        found.append(Recorded(page, m["command"], "\n".join(lines[i + 2:end]).rstrip("\n"),
                              i + 2, bool(m["slow"])))
    return found


# What a command prints that varies from run to run: a search's own timing.
TIMING = re.compile(r"(?<=compiled in )[\d.]+(?= s)|(?<=evaluated in )[\d.]+(?= s)"
                    r"|[\d,]+(?= layouts/s\))")


def masked(text: str) -> str:
    """The text with its run-to-run timings replaced by `#`."""
    return TIMING.sub("#", text)


def _blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) line indices of each fenced block's body whose first line is `$ opgraph`."""
    lines = text.split("\n")
    found, start = [], None
    for i, line in enumerate(lines):
        if FENCE.match(line):
            if start is None:
                start = i + 1
            else:
                if start < i and lines[start].startswith("$ opgraph "):
                    found.append((start, i))
                start = None
    return found


def _chunks(body: list[str]) -> list[tuple[str, str]]:
    """The `$` lines of a block body with what each shows (trailing blank lines dropped)."""
    chunks: list[tuple[str, list[str]]] = []
    for line in body:
        if line.startswith("$ "):
            chunks.append((line[2:], []))
        else:
            chunks[-1][1].append(line)
    return [(command, "\n".join(shown).rstrip("\n")) for command, shown in chunks]


def examples(page: Path) -> list[Example]:
    """Every example of one page, in order."""
    lines = page.read_text().split("\n")
    return [Example(page, command, shown, n)
            for n, (start, end) in enumerate(_blocks("\n".join(lines)))
            for command, shown in _chunks(lines[start:end])]


def argv(command: str) -> tuple[str, ...]:
    """The command's arguments after `opgraph`, `../shared` put where it is."""
    words = shlex.split(command)
    if words[0] != "opgraph":
        raise ValueError(f"not an opgraph command: {command}")
    return tuple(w.replace("../shared", str(SHARED)) for w in words[1:])


@functools.cache
def run(args: tuple[str, ...]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `opgraph ARGS`, run in process from a scratch folder;
    each distinct command runs once per process (pages that show the same command share it)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from opgraph.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(args))
        finally:
            os.chdir(here)
    unshare = str(SHARED)
    return code, out.getvalue().replace(unshare, "../shared"), err.getvalue().replace(
        unshare, "../shared")


STDERR = re.compile(r"on stderr[^`]*?:\n\n```\n(?P<shown>.*?)```", re.DOTALL)


def stderr_blocks(page: Path) -> list[tuple[re.Match, str]]:
    """Each block of a page that shows a command's stderr, with that command: the page's last
    `$ opgraph` line above it."""
    text = page.read_text()
    found = []
    for m in STDERR.finditer(text):
        commands = re.findall(r"^\$ (opgraph .*)$", text[:m.start()], re.MULTILINE)
        found.append((m, commands[-1]))
    return found


PYTHON = re.compile(r"## In Python\n.*?```python\n(?P<code>.*?)```\n\nprints\n\n```\n"
                    r"(?P<printed>.*?)```", re.DOTALL)


def python_example(text: str) -> re.Match:
    """The README's Python example: `code`, and `printed`, what the README says it prints."""
    return PYTHON.search(text)


def run_python(code: str) -> str:
    """What a page's Python code prints, run in a fresh namespace with the checkout's opgraph."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    return out.getvalue()


def missing(example: Example, out: str, err: str) -> list[str]:
    """The lines of an excerpt that the command did not print."""
    printed = masked(out + err)
    return [ln for ln in example.shown.splitlines() if ln != "..." and masked(ln) not in printed]


def _rewrite(page: Path, outputs: dict[tuple[int, str], str]) -> str:
    """The page with each full example's output replaced by `outputs[(block, command)]`."""
    lines = page.read_text().split("\n")
    for n, (start, end) in reversed(list(enumerate(_blocks("\n".join(lines))))):
        chunks = _chunks(lines[start:end])
        body: list[str] = []
        for command, shown in chunks:
            new = outputs.get((n, command), shown)
            body += ([""] if body else []) + [f"$ {command}", *new.split("\n")]
        lines[start:end] = body
    return "\n".join(lines)


def _rewrite_recorded(page: Path, record: Recorded, output: str) -> str:
    """The page with one recorded block's lines replaced by `output`."""
    lines = page.read_text().split("\n")
    end = next(i for i in range(record.block, len(lines)) if FENCE.match(lines[i]))
    lines[record.block:end] = output.split("\n")
    return "\n".join(lines)


def judge(item: Example, check: bool, mask=lambda text: text) -> tuple[int, int, str | None]:
    """One example or recorded block's command run and set beside what its page shows:
    (stale, needing a person, the output to write in its place or None), each finding printed.
    `mask` hides what varies from run to run (`masked`) before the whole output is compared."""
    code, out, err = run(argv(item.command))
    if code != 0:
        print(f"{item.name}: exit status {code}: {err.strip()}")
        return 1, 1, None
    if item.excerpt:
        lines = missing(item, out, err)
        for line in lines:
            print(f"{item.name}: excerpt line not printed: {line}")
        return len(lines), len(lines), None
    if mask(out.rstrip("\n")) != mask(item.shown):
        print(f"{item.name}: output {'differs' if check else 'rewritten'}")
        return 1, 0, out.rstrip("\n")
    return 0, 0, None


def check_recorded(page: Path, check: bool, slow: bool) -> tuple[int, int]:
    """(stale, needing a person) over one page's recorded blocks, each rewritten unless check;
    the slow ones are left out, with a note, unless slow."""
    stale = needs_a_person = 0
    rewrites: list[tuple[Recorded, str]] = []
    for record in recorded(page):
        if record.slow and not slow:
            print(f"{record.name}: not run, slow (--slow runs it)")
            continue
        s, p, output = judge(record, check, masked)
        stale, needs_a_person = stale + s, needs_a_person + p
        if output is not None:
            rewrites.append((record, output))
    if not check:
        for record, output in reversed(rewrites):  # the last first, so the others' lines stay put
            page.write_text(_rewrite_recorded(page, record, output))
    return stale, needs_a_person


def main(argv_: list[str]) -> int:
    """Exit status 1 when a person is needed: a command failed or an excerpt is stale, or,
    with --check, any output differs."""
    check = "--check" in argv_
    slow = "--slow" in argv_
    stale = needs_a_person = 0
    for page in pages():
        outputs: dict[tuple[int, str], str] = {}
        for ex in examples(page):
            if ex.needs_shared and not SHARED.is_dir():
                print(f"{ex.name}: not run, ../shared is not beside the repo")
                continue
            s, p, output = judge(ex, check)
            stale, needs_a_person = stale + s, needs_a_person + p
            if output is not None:
                outputs[(ex.block, ex.command)] = output
        if outputs and not check:
            page.write_text(_rewrite(page, outputs))
        for m, command in reversed(stderr_blocks(page)):
            _, _, err = run(argv(command))
            if err != m["shown"]:
                print(f"{page.relative_to(ROOT)}: {command}: stderr "
                      f"{'differs' if check else 'rewritten'}")
                stale += 1
                if not check:
                    text = page.read_text()
                    page.write_text(text[:m.start("shown")] + err + text[m.end("shown"):])
        stale_recorded, needs_recorded = check_recorded(page, check, slow)
        stale += stale_recorded
        needs_a_person += needs_recorded
    readme = ROOT / "README.md"
    example = python_example(readme.read_text())
    printed = run_python(example["code"])
    if printed != example["printed"]:
        print(f"README.md: the Python example's output {'differs' if check else 'rewritten'}")
        stale += 1
        if not check:
            text = readme.read_text()
            readme.write_text(text[:example.start("printed")] + printed
                              + text[example.end("printed"):])
    print(f"{stale} stale" if stale else "every example prints what its page shows")
    return 1 if needs_a_person or (check and stale) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
