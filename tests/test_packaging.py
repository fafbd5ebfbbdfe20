"""Issue 8, item 1: one import package. `opgraph.passes` and `opgraph.models` import first in a
fresh interpreter, `python -m opgraph` runs from a folder holding its own `models/` and
`passes/` packages, and a build puts only `opgraph` at the top of site-packages."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "opgraph", "passes", "models")


def run(argv: list[str], cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120, check=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """What an install puts into site-packages: setuptools' build of a copy of the sources
    (the checkout itself stays clean)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    lib = src / "lib"
    done = run(["-c", "import setuptools; setuptools.setup()", "-q", "build_py", "--build-lib",
                str(lib)], src, src)
    if done.returncode:
        pytest.skip(f"setuptools cannot build here: {done.stderr.strip().splitlines()[-1:]}")
    return lib


@pytest.fixture
def users_folder(tmp_path) -> Path:
    """A folder like an ML repo's, with its own `models` and `passes` packages."""
    for name in ("models", "passes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name} package was imported')\n")
    return tmp_path


def test_the_build_has_one_top_level_package(built):
    assert sorted(p.name for p in built.iterdir()) == ["opgraph"]
    for sub in ("passes", "models", "commands", "core", "cost", "parallel", "parallel/search",
                "analysis", "analysis/sweep", "analysis/traces", "io", "io/launch", "io/outputs"):
        assert (built / "opgraph" / sub / "__init__.py").is_file(), sub
    assert (built / "opgraph" / "hardware.toml").is_file()


def test_first_imports_and_python_m_beside_a_users_models(built, users_folder):
    """Fresh interpreters, started side by side, in the checkout and in the build."""
    env = {**os.environ}
    runs = {}
    checks = [("checkout", ["-c", "import opgraph.passes"]),
              ("checkout", ["-c", "import opgraph.models"]),
              ("installed", ["-c", "import opgraph.models"]),
              ("installed", ["-m", "opgraph", "profile", "--model", "gpt2", "--json"])]
    for layout, argv in checks:
        env["PYTHONPATH"] = str(ROOT if layout == "checkout" else built)
        runs[layout, argv[-1]] = subprocess.Popen(
            [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=users_folder, env=dict(env))
    for key, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (key, err)
        if key[1] == "--json":
            j = json.loads(out)
            assert j["model"] == "gpt2" and j["parameters"] == 124_439_808  # GPT-2 small
