"""The package's folders are its layers (docs/architecture.md): a module imports, when it is
loaded, only from its own layer and the layers it is allowed to, so that the folders show the
architecture. Imports inside a function (the command line's deferred ones) are not counted.
Two exceptions are named, each with its reason."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each layer, and the layers its modules may import when they load.
ALLOWED = {
    "core": set(),
    "models": {"core"},
    "cost": {"core"},
    # the passes read the layout and the frameworks' traits; the many-GPU layer runs the passes
    "passes": {"core", "cost", "parallel"},
    "parallel": {"core", "cost", "passes"},
    "io": {"core", "cost", "parallel", "passes", "models"},
    "analysis": {"core", "cost", "parallel", "passes", "models", "io"},
    "commands": {"core", "cost", "parallel", "passes", "models", "io", "analysis"},
}
EXCEPTIONS = {
    # one place per kind: define_kind fills the tables of every layer that holds a kind's traits
    ("opgraph/core/kinds.py", "cost"), ("opgraph/core/kinds.py", "passes"),
    # the planner draws its progress bar on stderr
    ("opgraph/parallel/search/searcher.py", "io"),
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "opgraph" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ALLOWED else None


def _module(path: Path) -> tuple[str, str]:
    """A file's dotted module name and its package, as installed (passes/ is opgraph.passes)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != "opgraph":
        parts = ["opgraph", *parts]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _imported(path: Path) -> list[str]:
    """What the module imports at its top level, as absolute module names."""
    _, package = _module(path)
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.level and not node.module or target == "opgraph":
                out += [f"{target}.{a.name}" for a in node.names]
            else:
                out.append(target)
    return out


def _files() -> list[Path]:
    return sorted([*ROOT.glob("opgraph/**/*.py"), *ROOT.glob("passes/*.py"),
                   *ROOT.glob("models/*.py")])


def test_every_module_imports_only_from_the_layers_below_it():
    wrong = []
    for path in _files():
        name, _ = _module(path)
        layer = _layer(name)
        if layer is None:  # opgraph/__init__.py, cli.py, __main__.py, _checkout.py
            continue
        for target in _imported(path):
            other = _layer(target)
            rel = path.relative_to(ROOT).as_posix()
            if (other is not None and other != layer and other not in ALLOWED[layer]
                    and (rel, other) not in EXCEPTIONS):
                wrong.append(f"{rel} imports {target}")
    assert not wrong, wrong


def test_the_named_exceptions_are_still_needed():
    """An exception the code no longer needs is taken off the list."""
    for rel, other in EXCEPTIONS:
        assert any(_layer(t) == other for t in _imported(ROOT / rel)), (rel, other)


def test_every_folder_is_a_layer_and_a_package():
    folders = {p.name for p in (ROOT / "opgraph").iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(ALLOWED) - {"passes", "models"}
    flat = {p.name for p in (ROOT / "opgraph").glob("*.py")}
    assert flat == {"__init__.py", "__main__.py", "_checkout.py", "cli.py"}
