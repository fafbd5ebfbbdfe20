"""Issue 23: `--help` and argument errors return at once. The parser is built from light modules
only (`opgraph.core.choices`, `opgraph.core.limits`, `opgraph.commands.options`); sympy, networkx,
numpy, the models and the passes load when a command runs. Structural, not timed: each case runs in
a fresh interpreter, and what it imported is read from `sys.modules`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opgraph.core import choices
from opgraph.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("sympy", "networkx", "numpy", "matplotlib", "opgraph.models", "opgraph.passes")

# Each argv, and the exit status it must end with: 0 for help, 2 for a one-line error.
CASES = [(["--help"], 0), (["-h"], 0), (["--version"], 0),
         *[([name.replace("_", "-"), "--help"], 0)
           for name in COMMANDS],
         (["frobnicate"], 2),                                  # no such command
         (["profile", "--no-such-flag"], 2),                   # unknown flag
         (["--jsn"], 2),                                       # `opgraph --jsn` is profile's
         (["profile", "--tp", "x"], 2),                        # not a whole number
         (["profile", "--recompute", "sometimes"], 2),         # not one of the choices
         (["profile", "--model", " "], 2),                     # an empty value
         (["plan", "--gpus", "64"], 2),                        # --tokens or --global-batch needed
         (["plan", "--gpus", "64", "--tokens", "-8"], 2),      # not positive
         (["sweep", "--rows", "0"], 2),
         (["diff", "--b-precision", "fp4"], 2)]

_PROBE = """
import contextlib, io, json, sys
from opgraph.cli import main
heavy, report = {heavy!r}, []
for argv, _ in {cases!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's --help and --version
            code = e.code
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy or m in heavy
                    or any(m.startswith(h + ".") for h in heavy))
    report.append([argv, code, loaded])
print(json.dumps(report))
"""


def _probe(cases) -> list:
    code = _PROBE.format(heavy=HEAVY, cases=cases)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_help_and_argument_errors_import_no_heavy_module():
    """One interpreter runs every case in turn: the first case that loads a heavy module is
    named (the later ones would only inherit it)."""
    report = _probe(CASES)
    assert [(argv, code) for argv, code, _ in report] == [(argv, code) for argv, code in CASES]
    first = next(((argv, loaded) for argv, _, loaded in report if loaded), None)
    assert first is None, f"`opgraph {' '.join(first[0])}` imported {first[1][:8]}"


def test_the_roofline_profile_loads_no_numpy():
    """The plate (`opgraph profile`, the roofline) is sympy and plain floats: numpy's 60 ms of
    import is paid by the commands that use it (the calibrated model, sweeps, plans)."""
    (_, code, loaded), = _probe([(["profile", "--json"], 0)])
    assert code == 0 and "sympy" in loaded
    assert not [m for m in loaded if m.split(".")[0] == "numpy"]


def test_the_probe_sees_a_heavy_import():
    """The check above can fail: a command that runs (`models` lists the presets) loads them."""
    (_, code, loaded), = _probe([(["models", "--json"], 0)])
    assert code == 0 and "opgraph.models" in loaded and "sympy" in loaded


def test_the_parsers_names_are_the_tables_keys():
    """`opgraph.core.choices` holds the names the parser offers; each table that gives them their
    meaning has exactly those keys, in the order the help lists them."""
    from opgraph.cost import costmodel
    from opgraph.core import fusion
    from opgraph.parallel import parallel
    from opgraph.passes import attach_adamw, precision, recompute

    assert tuple(fusion.POLICIES) == choices.FUSION_POLICIES
    assert tuple(recompute.POLICIES) == choices.RECOMPUTE_POLICIES
    assert tuple(attach_adamw.ADAMW_OPTIONS) == choices.ADAMW_OPTIONS
    assert precision.PRECISIONS is choices.PRECISIONS
    assert costmodel.BACKWARD_MODES is choices.BACKWARD_MODES
    assert costmodel.COST_MODELS is choices.COST_MODELS
    assert parallel.ZERO_STAGES is choices.ZERO_STAGES
    assert parallel.FRAMEWORKS is choices.FRAMEWORKS
    assert parallel.GRAD_REDUCE_DTYPES is choices.GRAD_REDUCE_DTYPES
    from opgraph.parallel.frameworks import FRAMEWORKS as TRAITS  # None: the generic model

    assert set(TRAITS) == {None, *choices.FRAMEWORKS}
    from opgraph.passes.pick_attention_kernel import KERNELS  # "flash": the kinds' own rates

    assert ("flash", *KERNELS) == choices.ATTENTION_LIBRARIES
    from opgraph.cost.profile import LIBRARY_NAMES

    assert tuple(LIBRARY_NAMES) == choices.ATTENTION_LIBRARIES


@pytest.mark.parametrize("first", ["import opgraph.core.pipeline", "import opgraph.core.verify",
                                   "pass"])
def test_the_packages_names_load_on_first_use(first):
    """`from opgraph import verify` is the function whatever was imported before it (the
    verifier's module, opgraph.core.verify, is not bound over it), and `import *` gives every
    name."""
    code = (f"{first}\nimport sys, opgraph\nfrom opgraph import *\n"
            "from opgraph import verify as v\n"
            "print(v is sys.modules['opgraph.core.verify'].verify is opgraph.verify, "
            "sorted(n for n in opgraph.__all__ if n not in globals()), "
            "'compile_step' in dir(opgraph))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "[]", "True"]
