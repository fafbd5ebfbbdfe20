"""`opgraph models`: the presets, with parameter counts derived from their graphs."""

from __future__ import annotations

from .args import json_text


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "models", help="list the model presets and their parameter counts",
        description="Each preset's parameters (all of them; for a mixture of experts also those "
                    "one token uses), counted from its graph, and its main dimensions.")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(func=run)


def describe(name: str) -> dict:
    """One preset's row: `describe("gpt2")["parameters"] == 124_439_808`."""
    from opgraph.core.parameters import active_parameters, is_routed
    from opgraph.core.symbols import BY_NAME
    from opgraph.models import preset

    graph = preset(name)
    dims = graph.dims
    row = {"name": name, "parameters": int(graph.parameters().xreplace(dims))}
    if is_routed(graph):
        row["active_parameters"] = int(active_parameters(graph).xreplace(dims))
    row["dimensions"] = {sym.name: int(v) for sym, v in dims.items()
                         if sym.name in BY_NAME and sym.name not in ("B", "S")}
    row["seq_len"] = graph.seq_len
    return row


def format_models(rows: list[dict]) -> str:
    lines = [(f"{'model':<16} {'parameters':>17} {'active':>17} {'d_model':>7} {'layers':>6} "
              f"{'heads':>5} {'kv':>3} {'experts':>7} {'seq_len':>7}")]
    for r in rows:
        d = r["dimensions"]
        active = f"{r['active_parameters']:,}" if "active_parameters" in r else "-"
        experts = f"{d['K']} of {d['E']}" if "E" in d else "-"
        lines.append(f"{r['name']:<16} {r['parameters']:>17,} {active:>17} {d['D']:>7} "
                     f"{d['L']:>6} {d['H']:>5} {d.get('H_kv', d['H']):>3} {experts:>7} "
                     f"{r['seq_len'] or '-':>7}")
    return "\n".join(lines)


def run(args) -> int:
    from opgraph.models import PRESETS

    rows = [describe(name) for name in PRESETS]
    if args.json:
        print(json_text(rows))
    else:
        print(format_models(rows))
    return 0
