from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def shared() -> Path:
    """`../shared` beside the repo; tests that need it skip where it is absent."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not beside the repo")
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
