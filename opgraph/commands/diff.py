"""`opgraph diff`: two training steps side by side. Side A is described by the usual model
options; side B is side A with the `--b-` options changed:

    opgraph diff --model llama3-8b --b-no-fused-attention      # fused (A) vs unfused (B)
    opgraph diff --no-fused-attention --b-fused-attention      # what fusing attention buys
    opgraph diff --model llama3-8b --b-model llama3-70b --b-hardware b200

Every option of `add_model_args` gets a `--b-` twin here, with the same type and choices, so an
option added there (a new pass, say) can be diffed without touching this file. A switch
`--X` gets `--b-X` and `--b-no-X`; a switch `--no-X` gets `--b-no-X` and `--b-X`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..core.errors import OpgraphError
from .options import add_model_args

# Options that name the same thing: giving one on side B drops side A's other.
ALTERNATIVES = (("model", "config"),)


# A dataclass, not an attrs record: the parser is built from the standard library and light
# modules only, and attrs alone takes a quarter of `opgraph --help`'s time.
@dataclasses.dataclass(frozen=True)
class Twin:
    """One side-B option: `--b-NAME`, the side-A attribute it sets, and for a switch the value
    it sets it to (None: the option takes a value)."""

    flag: str
    dest: str
    option: str  # side A's flag
    const: object = None
    kwargs: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def b_dest(self) -> str:  # a switch's two twins share it: the last one given wins
        return f"b_{self.dest}"


class _Recorder:
    """Stands in for an ArgumentParser to learn which options `add_model_args` adds."""

    def __init__(self):
        self.options: list[tuple[tuple[str, ...], dict]] = []

    def add_argument_group(self, *args, **kwargs):
        return self

    def add_mutually_exclusive_group(self, *args, **kwargs):
        return self

    def add_argument(self, *names, **kwargs):
        self.options.append((names, kwargs))


def twins() -> list[Twin]:
    """Side B's options, derived from `add_model_args`."""
    recorder = _Recorder()
    add_model_args(recorder)
    out = []
    for names, kwargs in recorder.options:
        long = next(n for n in names if n.startswith("--"))
        dest = kwargs.get("dest") or long[2:].replace("-", "_")
        action = kwargs.get("action")
        if action in ("store_true", "store_false"):
            on = action == "store_true"
            base = long[2:].removeprefix("no-")
            negative = long[2:].startswith("no-")
            out.append(Twin(f"--b-{long[2:]}", dest, long, on))
            out.append(Twin(f"--b-{base}" if negative else f"--b-no-{base}", dest, long, not on))
        else:
            keep = {k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar",
                                                              "action", "nargs", "const")}
            if action in (None, "store", "append"):
                keep.setdefault("metavar", dest.upper())
            out.append(Twin(f"--b-{long[2:]}", dest, long, None, keep))
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "diff", help="two training steps side by side: ops removed, added and changed",
        description="Side A is the step the usual model options describe; side B is side A "
                    "with each --b-OPTION given replacing --OPTION. Ops are matched by name: "
                    "removed (A only), added (B only) or changed (kind, inputs, outputs, FLOPs "
                    "or bytes differ), listed most time saved first with their time, FLOPs, "
                    "HBM bytes and resident memory as A > B, then the step's totals (time, MFU "
                    "ceiling, memory, FLOPs, bytes) and, for one model on both sides, the "
                    "totals' change as formulas.",
        epilog="Examples: `opgraph diff --no-fused-attention --b-fused-attention` (what fusing "
               "attention buys); `opgraph diff --b-tokens 65536`; `opgraph diff --b-hardware "
               "b200`; `opgraph diff --model llama3-8b --b-model llama3-70b`; `opgraph diff "
               "--b-backward-traffic tensors`. A switch --X has --b-X and --b-no-X.")
    add_model_args(p)
    g = p.add_argument_group("side B (each replaces side A's option of the same name)")
    for t in twins():
        if t.const is None:
            g.add_argument(t.flag, dest=t.b_dest, default=argparse.SUPPRESS,
                           help=f"side B's {t.option}", **t.kwargs)
        else:
            on = t.flag == f"--b-{t.option[2:]}"
            g.add_argument(t.flag, dest=t.b_dest, action="store_const", const=t.const,
                           default=argparse.SUPPRESS,
                           help=f"side B {'with' if on else 'without'} {t.option}")
    p.add_argument("--formulas", action="store_true",
                   help="also give each op's change in FLOPs, bytes and memory as a formula")
    p.add_argument("--all", action="store_true",
                   help="list the unchanged ops too (their time changes with the hardware)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: a, b, removed, added, changed, totals")
    p.set_defaults(func=run)


def side_b(args) -> tuple[argparse.Namespace, list[str]]:
    """Side B's options (side A's with the `--b-` ones put in) and those changes as text."""
    b = argparse.Namespace(**vars(args))
    given: dict[str, object] = {}
    changes = []
    for t in twins():
        if hasattr(args, t.b_dest) and t.dest not in given:
            value = getattr(args, t.b_dest)
            if t.const is not None and value != t.const:
                continue  # the other switch of the pair set it
            given[t.dest] = value
            flag = f"--{t.flag[4:]}"
            changes.append(flag if t.const is not None else f"{flag} {value}")
    for group in ALTERNATIVES:
        if any(name in given for name in group):
            for name in group:
                setattr(b, name, given.get(name))
    for dest, value in given.items():
        setattr(b, dest, value)
    return b, changes


def run(args) -> int:
    from ..analysis.diff import diff_steps, format_diff
    from .common import setup

    b_args, changes = side_b(args)
    if not changes:
        raise OpgraphError("side B is the same as side A; give at least one --b- option, "
                           "e.g. --b-no-fused-attention (see `opgraph diff --help`)")
    a = setup(args)
    try:
        b = setup(b_args)
    except OpgraphError as e:
        raise OpgraphError(f"side B ({' '.join(changes)}): {e}") from None
    d = diff_steps(a.step, b.step, a.hardware, a.values, b_hardware=b.hardware,
                   b_values=b.values, cost=a.cost, b_cost=b.cost)
    if args.json:
        out = d.to_json()
        out["b"]["options"] = changes
        print(json.dumps(out, indent=2))
    else:
        print(format_diff(d, b_options=" ".join(changes), formulas=args.formulas,
                          every_op=args.all))
    return 0
