"""Small data files a user gives (a hardware or cluster TOML, a config.json): read without
reading more than a data file can be, parsed with every failure one line, and looked up by id.

    text = read_small(path, "config file")                   # /dev/zero is one line, not a hang
    tables = load_tables(path, "hardware file", is_one=...)  # id -> table
    part = pick("h100-sxm", load, catalog, "hardware")       # a catalog id or a .toml path
"""

from __future__ import annotations

import contextlib
import os
import stat
import tomllib
from collections.abc import Callable
from pathlib import Path

from .errors import OpgraphError, did_you_mean
from .limits import CONFIG_MAX_BYTES


def read_small(path: str | Path, what: str, limit: int = CONFIG_MAX_BYTES) -> str:
    """The text of a small file of at most `limit` bytes, read without reading more:
    `/dev/zero` or a huge file is one line, not a hang."""
    path = Path(path)
    with contextlib.suppress(OSError):
        if stat.S_ISFIFO(os.stat(path).st_mode):  # opening it would wait for a writer
            raise OpgraphError(f"{what} {path} is a FIFO; give a file")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise OpgraphError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise OpgraphError(f"{what} {path} is a directory; give a file") from None
    except OSError as e:
        raise OpgraphError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise OpgraphError(f"{what} {path} is larger than {limit // 1024:,} KiB; a {what} is a "
                           "few KiB: is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise OpgraphError(f"{what} {path} is not UTF-8 text") from None


def load_tables(path: str | Path, what: str, *, noun: str, example: str,
                is_one: Callable[[dict], bool]) -> dict[str, dict]:
    """A TOML file's tables by id. A file that holds one entry without its enclosing table
    (`is_one(data)`) is that entry, its id the file's stem. `noun` names an entry and `example`
    says what its table looks like, for the error an empty file gets."""
    path = Path(path)
    if not str(path).strip():
        raise OpgraphError(f"the {what} name is empty; give a .toml file or a catalog id")
    text = read_small(path, what)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise OpgraphError(f"{what} {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise OpgraphError(f"{what} {path} nests too deeply; it is not a {what}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise OpgraphError(f"{what} {path}: {str(e).split(':')[0]}") from None
    if not data:
        raise OpgraphError(f"{what} {path} defines no {noun}; add a table like {example}")
    return {path.stem: data} if is_one(data) else data


def check_keys(table: dict, allowed: set[str], where: str) -> None:
    """One line naming the first key of `table` not in `allowed`: a misspelt key is an error,
    never a figure silently left at its default."""
    extra = sorted(set(table) - allowed)
    if extra:
        raise OpgraphError(f"{where}: unknown key {extra[0]!r}; the keys are "
                           f"{', '.join(sorted(allowed))}")


def pick(name: str, load: Callable[[str], dict], catalog: Callable[[], dict], what: str):
    """A catalog entry by id, or the single entry of a .toml file (a name ending in .toml or
    holding a /)."""
    if name.endswith(".toml") or "/" in name:
        entries = load(name)
        if len(entries) != 1:
            raise OpgraphError(f"{what} file {name} defines {len(entries)} entries; keep one "
                               "table in it")
        return next(iter(entries.values()))
    entries = catalog()
    try:
        return entries[name]
    except KeyError:
        raise OpgraphError(f"unknown {what} {name!r}{did_you_mean(name, entries)}; choose one "
                           f"of: {', '.join(entries)}, or give a .toml file") from None


def shipped_tables(folder: Path, prefix: str) -> dict[str, Path]:
    """The measured CSV tables installed in `folder` as `<prefix><name>.csv`, by name."""
    return {p.stem.removeprefix(prefix): p for p in sorted(folder.glob(f"{prefix}*.csv"))}


def locate_table(name_or_path: str, tables: dict[str, Path], what: str, rows: str) -> str:
    """A shipped table's path by its name (`h200`), or the path given, which must be a file:
    else one line naming what a table holds (`rows`) and the shipped ones."""
    if name_or_path in tables:
        return str(tables[name_or_path])
    if not Path(name_or_path).is_file():
        raise OpgraphError(f"no {what} {name_or_path!r}: give a CSV file of {rows} rows or a "
                           f"shipped table ({', '.join(tables)})")
    return name_or_path


def csv_rows(path: str, what: str, required: tuple[str, ...], needs: str,
             aliases: dict[str, str] | None = None):
    """A small CSV table's header, lower-cased (names in `aliases` mapped), and its non-empty
    rows as (where, cells), each checked to hold a value per header name: one line per
    mistake, naming the file and line. `required` are the columns it must have; `needs` says
    what a table holds, for the error."""
    import csv
    import io

    reader = csv.reader(io.StringIO(read_small(path, what)))
    aliases = aliases or {}
    header = next(reader, None)
    if not header:
        raise OpgraphError(f"{path}: the {what} is empty; give a CSV header line naming "
                           f"{needs}")
    names = [aliases.get(h.strip().lower(), h.strip().lower()) for h in header]
    missing = [c for c in required if c not in names]
    if missing:
        raise OpgraphError(f"{path}: the header has no {', '.join(missing)} column; it needs "
                           f"{needs}")
    rows = []
    for line, cells in enumerate(reader, start=2):
        if not any(cell.strip() for cell in cells):
            continue
        where = f"{path}, line {line}"
        if len(cells) < len(names):
            raise OpgraphError(f"{where}: {len(cells)} values where the header names "
                               f"{len(names)}")
        rows.append((where, [cell.strip() for cell in cells]))
    if not rows:
        raise OpgraphError(f"{path}: the {what} has a header but no rows")
    return names, rows
