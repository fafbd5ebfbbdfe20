"""Progress bars: on stderr while a person watches (a terminal), and nothing otherwise."""

import io
import sys

from opgraph.io.outputs.progress import progress, progressed

PLAN = ("plan", "--model", "gpt2", "--gpus", "2", "--global-batch", "4", "--top", "2")


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, and keeps what is written to it."""

    def isatty(self) -> bool:
        return True


def test_nothing_when_stderr_is_not_a_terminal(cli):
    code, out, err = cli(*PLAN)  # pytest's captured stderr is no terminal
    assert code == 0 and "tp1" in out
    assert err == ""


def test_a_terminal_gets_the_plan_progress(monkeypatch, capsys):
    from opgraph.cli import main

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(list(PLAN)) == 0
    written = terminal.getvalue()
    assert "plan: bounding layouts" in written and "plan: structures compiled" in written
    assert "plan:" not in capsys.readouterr().out  # the table's stdout carries no bar
    # --rank counts the layouts that fit over every structure of the lifted space, its longest
    # part, and ranks the best against them
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*PLAN, "--tp", "1", "--rank"]) == 0
    written = terminal.getvalue()
    assert "plan: counting the layouts that fit" in written and "plan: ranking" in written


def test_the_helper_counts_on_a_terminal_only(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progressed(range(3), "counting", unit="thing")) == [0, 1, 2]
    assert "counting" in terminal.getvalue() and "0/3" in terminal.getvalue()
    plain = io.StringIO()  # isatty() False
    monkeypatch.setattr(sys, "stderr", plain)
    assert list(progressed(range(3), "counting")) == [0, 1, 2]
    with progress("silent", total=2) as bar:
        bar.update()
        bar.set_postfix_str("x")
    assert plain.getvalue() == ""


def test_a_terminal_gets_the_validate_progress(monkeypatch):
    from opgraph.cli import main

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["validate", "--select", "korthikanti22_tab5_22B_full"]) == 0
    assert "validate: cases" in terminal.getvalue()
