"""The docs' lists of names, entry points and flags, held to the code they describe.

docs/torch-api.md: every aelastic name in a row imports (a module, or an attribute of one),
and a row that says "not provided" names nothing aelastic has (no public definition of that
name, no environment variable aelastic reads by that name, no rendezvous, backend, store or
handler of torch's named after a backend aelastic registers); its ``LaunchConfig`` row lists
every backend. docs/torchrun-plugin.md: the entry points it shows and lists are
pyproject.toml's. docs/cli.md: the flags of its two ``aelastic run`` tables are the parser's.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from aelastic.backends.registry import BUILTINS
from aelastic.cli.run_flags import build_parser

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the lock's Python is 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "aelastic"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _rows(path: Path) -> list[tuple[str, list[str]]]:
    """Every table row of a page (header and rule lines left out), with its section."""
    rule = re.compile(r"\|[-|\s:]+\|")
    lines = path.read_text().splitlines()
    section, rows = "", []
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("|") and not rule.fullmatch(line) and not rule.fullmatch(after):
            rows.append((section, _cells(line)))
    return rows


def _spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _resolve(dotted: str) -> Any:
    """The module or attribute a dotted aelastic name means (ImportError/AttributeError)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _names_in(cell: str, torch_cell: str) -> list[str]:
    """The dotted aelastic names a cell gives: ``aelastic.x.Y``, ``aelastic.{A, B}``,
    ``aelastic.x.*`` (torch's names of the row), ``from aelastic.x import A, B``,
    ``import aelastic.x as y``."""
    torch_names = [
        name.strip().split("(")[0].split(".")[-1]
        for span in _spans(torch_cell)
        for name in span.split(",")
    ]
    names: list[str] = []
    for span in _spans(cell):
        if m := re.fullmatch(r"from (aelastic[\w.]*) import (.+)", span):
            names += [f"{m[1]}.{n.strip()}" for n in m[2].split(",") if n.strip() != "..."]
        elif m := re.fullmatch(r"import (aelastic[\w.]*)( as \w+)?", span):
            names.append(m[1])
        elif m := re.fullmatch(r"(aelastic[\w.]*)\.\{(.+)\}", span):
            names += [f"{m[1]}.{n.strip()}" for n in m[2].split(",")]
        elif m := re.fullmatch(r"(aelastic[\w.]*)\.\*", span):
            names += [f"{m[1]}.{n}" for n in torch_names if n.isidentifier()]
        elif m := re.match(r"(aelastic(?:\.\w+)+)", span):
            names.append(m[1])
    return names


API_ROWS = [cells for _, cells in _rows(DOCS / "torch-api.md")]


def test_the_torch_api_page_has_its_rows() -> None:
    assert len(API_ROWS) > 50
    assert sum(row[2] == "not provided" for row in API_ROWS if len(row) == 4) >= 5


@pytest.mark.parametrize("row", API_ROWS, ids=lambda row: row[0][:60])
def test_every_aelastic_name_of_a_torch_api_row_imports(row: list[str]) -> None:
    names = [n for cell in row[1:] for n in _names_in(cell, row[0])]
    missing = []
    for name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    assert not missing, f"docs/torch-api.md names what aelastic lacks: {missing}"
    for flag in (m for cell in row[1:] for m in re.findall(r"`aelastic run (--[\w-]+)", cell)):
        assert flag in _run_flags(), f"docs/torch-api.md: `aelastic run {flag}` is no flag"
    for name in (m for cell in row[1:] for m in re.findall(r"`--rdzv-backend ([\w-]+)`", cell)):
        assert name in _backend_names(), f"docs/torch-api.md: no backend {name!r}"


@cache
def _definitions() -> dict[str, set[str]]:
    """Public names aelastic defines (functions, classes, module constants), by module."""
    defined: dict[str, set[str]] = {}
    for module, tree in _sources():
        for node in tree.body:
            targets: list[str] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                targets = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                targets = [node.target.id]
            for name in targets:
                if not name.startswith("_"):
                    defined.setdefault(name, set()).add(module)
    return defined


@cache
def _strings() -> set[str]:
    """The strings aelastic's code holds (the environment variables it reads among them)."""
    return {
        node.value
        for _, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@cache
def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (".".join(path.relative_to(ROOT).with_suffix("").parts), ast.parse(path.read_text()))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


@cache
def _backend_names() -> set[str]:
    names = {info.name for info in BUILTINS}
    names |= {alias for info in BUILTINS for alias in info.aliases}
    names |= {info.torchrun_alias for info in BUILTINS if info.torchrun_alias}
    return names


def _words(name: str) -> set[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return {w.lower() for w in re.split(r"[._\s]+", spaced) if w}


#: What a torch name is, when it is a rendezvous backend's piece (``EtcdRendezvousHandler``,
#: ``etcd_store.EtcdStore``; ``EtcdServer``, a test server, is not).
ROLES = {"rendezvous", "backend", "store", "handler"}
NOT_PROVIDED = [row for row in API_ROWS if len(row) == 4 and row[2] == "not provided"]


@pytest.mark.parametrize("row", NOT_PROVIDED, ids=lambda row: row[0][:60])
def test_a_torch_api_row_not_provided_names_nothing_aelastic_has(row: list[str]) -> None:
    defined = _definitions()
    backends = {name for name in _backend_names() if "-" not in name}
    provided = []
    for span in _spans(row[0]):
        for dotted in (part.strip() for part in span.split(",")):
            name = dotted.split("(")[0].split(".")[-1]
            if re.fullmatch(r"[A-Z][A-Z0-9_]+", name):
                if name in _strings():
                    provided.append(f"{name} (aelastic reads it)")
                continue
            if name in defined:
                provided.append(f"{name} (defined in {sorted(defined[name])})")
            words = _words(name)
            if words & ROLES:  # torch's rendezvous piece for a backend aelastic has
                for backend in sorted(words & backends):
                    provided.append(f"{dotted} (aelastic has the {backend!r} backend)")
    assert not provided, f'docs/torch-api.md says "not provided" for what aelastic has: {provided}'


def test_the_launch_config_row_lists_every_backend() -> None:
    (row,) = [row for row in API_ROWS if row[0] == "`LaunchConfig`"]
    listed = row[3].split("Backend names:", 1)[1].split(".", 1)[0]
    named = {name for name in _spans(listed) if name != "aelastic-*"}
    ours = {info.name for info in BUILTINS}
    assert named >= ours, f"docs/torch-api.md's LaunchConfig row leaves out {ours - named}"
    assert named <= _backend_names(), f"no such backends: {named - _backend_names()}"


def _pyproject_group(group: str) -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(meta["project"]["entry-points"][group])


def test_the_torchrun_plugin_page_shows_pyprojects_entry_points() -> None:
    text = (DOCS / "torchrun-plugin.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    shown = [tomllib.loads(b) for b in blocks if "torchrun.handlers" in b]
    assert len(shown) == 1, "docs/torchrun-plugin.md shows no torchrun.handlers block"
    theirs = shown[0]["project"]["entry-points"]["torchrun.handlers"]
    assert theirs == _pyproject_group("torchrun.handlers")


def test_the_torchrun_plugin_table_lists_every_entry_point() -> None:
    listed = {
        cells[0].strip("`")
        for _, cells in _rows(DOCS / "torchrun-plugin.md")
        if cells[0].startswith("`aelastic-")
    }
    assert listed == set(_pyproject_group("torchrun.handlers"))


@cache
def _run_flags() -> set[str]:
    """``aelastic run``'s flags, each in its spellings but the ``--snake_case`` aliases."""
    flags = set()
    for action in build_parser()._actions:
        dashed = [o for o in action.option_strings if "_" not in o]
        flags |= set(dashed or action.option_strings)
    return flags


def test_the_cli_page_lists_the_flags_of_aelastic_run() -> None:
    documented: set[str] = set()
    for section, cells in _rows(DOCS / "cli.md"):
        if section in ("torchrun's flags, one by one", "aelastic's own flags"):
            documented |= set(re.findall(r"`(-[-\w]+)", cells[0]))
    assert documented, "docs/cli.md has no flag table"
    assert sorted(_run_flags() - documented) == [], "flags docs/cli.md does not list"
    assert sorted(documented - _run_flags()) == [], "flags docs/cli.md lists that do not exist"
