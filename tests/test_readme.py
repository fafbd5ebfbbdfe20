"""The README's Python example runs and prints what the README says it prints."""

import contextlib
import io
import re
from pathlib import Path

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
