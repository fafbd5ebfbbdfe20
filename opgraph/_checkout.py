"""Where `opgraph.passes` and `opgraph.models` come from when opgraph runs from its source tree.

The repository keeps the passes and the model zoo in top-level folders, `passes/` and `models/`;
pyproject's `package-dir` installs them as the subpackages `opgraph.passes` and `opgraph.models`,
so an install puts only `opgraph` into site-packages. Run from the checkout itself (its root on
`sys.path`, as `python -m opgraph` or `python -m pytest` there), the `opgraph/` folder is found
first and has no such subfolders; this finder maps the two names onto the checkout's folders.
It is installed only when those folders sit beside `opgraph/` and `opgraph/` lacks them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

SUBPACKAGES = ("passes", "models")


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `opgraph.<sub>` in `root/<sub>` for each of SUBPACKAGES."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        package, _, sub = name.partition(".")
        if package != "opgraph" or sub not in SUBPACKAGES:
            return None
        folder = self.root / sub
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install(package_dir: Path) -> None:
    """Put a CheckoutFinder on `sys.meta_path` if `package_dir` is a checkout's `opgraph/`."""
    root = package_dir.parent
    checkout = all(not (package_dir / sub).is_dir() and (root / sub / "__init__.py").is_file()
                   for sub in SUBPACKAGES)
    if checkout and not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(root))
