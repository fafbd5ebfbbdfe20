"""The README's Python example runs and prints what the README says it prints."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from conftest import SHARED

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_in_python_example_prints_what_it_says():
    section = _section(README.read_text(), "In Python")
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    printed = re.search(r"\nprints\n\n```\n(.*?)```", section, re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    assert out.getvalue() == printed


def _commands():
    """Each `$ opgraph ...` line in the README's code blocks, with the output shown under it
    (up to the next `$` line or the block's end)."""
    text = README.read_text()
    for block in re.findall(r"```\n(\$ opgraph .*?)```", text, re.DOTALL):
        for chunk in re.split(r"\n(?=\$ )", block.strip("\n")):
            line, _, shown = chunk.partition("\n")
            yield line[2:], shown.rstrip("\n")


COMMANDS = list(_commands())


@pytest.mark.parametrize("command, shown", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_every_command_the_readme_shows_prints_what_it_shows(cli, command, shown):
    """Honest docs: the README's outputs are the program's. A block with a `...` line shows
    an excerpt: its other lines must each appear in what the command prints."""
    shared = SHARED
    if "../shared" in command and not shared.is_dir():
        pytest.skip("../shared is not beside the repo")
    argv = [a.replace("../shared", str(shared)) for a in shlex.split(command)[1:]]
    code, out, err = cli(*argv)
    assert code == 0, err
    printed = (out + err).replace(str(shared), "../shared")
    if "\n...\n" in f"\n{shown}\n":
        missing = [ln for ln in shown.splitlines() if ln != "..." and ln not in printed]
        assert not missing, f"{command}: not printed: {missing}"
    else:
        assert out.replace(str(shared), "../shared").rstrip("\n") == shown
