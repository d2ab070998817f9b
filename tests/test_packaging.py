"""Packaging contracts: no torch in the core, third-party backends found by entry point."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CORE_MODULES = [
    "aelastic",
    "aelastic.rendezvous",
    "aelastic.sync",
    "aelastic.store",
    "aelastic.backends.memory",
    "aelastic.backends.redis",
    "aelastic.backends.http.client",
    "aelastic.backends.http.server",
    "aelastic.backends.etcd",
    "aelastic.agent",
    "aelastic.cli",
    "aelastic.launcher",
    "aelastic.run",
    "aelastic.web",
    "aelastic.web.pages",
    "aelastic.web.dashboard",
]


def test_core_imports_and_forms_a_rendezvous_without_torch() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        for name in {CORE_MODULES!r}:
            __import__(name)
        from aelastic import RendezvousParameters, sync
        handler = sync.create_handler(RendezvousParameters("memory", "", "run", 1, 1))
        assert handler.next_rendezvous().world_size == 1
        handler.close()
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not leaked, leaked
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_third_party_backend_is_found_through_its_entry_point(tmp_path: Path) -> None:
    package = tmp_path / "thirdparty_backend.py"
    package.write_text(
        textwrap.dedent(
            """
            from aelastic.backends.memory import MemoryBackend

            def create_backend(params):
                return MemoryBackend(params.run_id, "thirdparty")
            """
        )
    )
    dist = tmp_path / "thirdparty_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-backend\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[aelastic.backends]\nthirdparty = thirdparty_backend:create_backend\n"
    )
    code = textwrap.dedent(
        """
        from aelastic import RendezvousParameters
        from aelastic.backends import backend_names
        from aelastic.rendezvous import create_handler
        assert "thirdparty" in backend_names()
        handler = create_handler(RendezvousParameters("thirdparty", "", "run", 1, 1))
        print(type(handler.backend).__name__, handler.get_backend())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parent.parent}", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["MemoryBackend", "thirdparty"]


def test_a_missing_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from aelastic import RendezvousParameters
    from aelastic.backends import registry

    row = registry.BackendInfo("fake", "aelastic_missing_module_xyz", "redis", "-", True, "-")
    monkeypatch.setitem(registry._BY_NAME, "fake", row)
    monkeypatch.delitem(registry._registry, "fake", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'aelastic\[redis\]'"):
        registry.create_backend(RendezvousParameters("fake", "", "run", 1, 1))


def test_the_etcd_backend_needs_no_extra() -> None:
    """etcd's row names no extra, and the backend imports and is created without aiohttp."""
    from aelastic.backends.registry import backend_info

    info = backend_info("etcd")
    assert info is not None and info.extra is None
    code = textwrap.dedent(
        """
        import sys
        sys.modules["aiohttp"] = None  # any import of it fails
        from aelastic import RendezvousParameters
        from aelastic.backends import create_backend
        backend = create_backend(RendezvousParameters("etcd", "127.0.0.1:1", "run", 1, 1))
        print(type(backend).__name__, "aiohttp" in sys.modules and sys.modules["aiohttp"])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["EtcdBackend", "None"]


# -- layers ---------------------------------------------------------------------------------

_PACKAGE = Path(__file__).resolve().parent.parent / "aelastic"

#: What each layer may import from aelastic (the ground floor imports nothing above it).
_LAYERS = {
    "core": {"core"},
    "backends": {"core", "backends"},
    "rendezvous": {"core", "backends", "rendezvous"},
    "agent": {"core", "backends", "rendezvous", "agent", "worker"},
    "worker": {"worker"},
    "launcher": {"core", "backends", "rendezvous", "agent", "launcher"},
    "web": {"core", "backends", "web"},
    "sync": {"core", "backends", "rendezvous", "sync"},
}


def _aelastic_imports(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    package = path.relative_to(_PACKAGE.parent).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts] if node.module else [[*base, a.name] for a in node.names]
            else:
                names = [node.module.split(".")] if node.module else []
            for parts in names:
                if parts and parts[0] == "aelastic" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "aelastic" and len(parts) > 1:
                    found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(_LAYERS))
def test_layers_import_nothing_above_them(layer: str) -> None:
    files = [_PACKAGE / "sync.py"] if layer == "sync" else sorted((_PACKAGE / layer).rglob("*.py"))
    assert files
    for path in files:
        above = _aelastic_imports(path) - _LAYERS[layer]
        assert not above, f"{path.relative_to(_PACKAGE)} imports {sorted(above)}"


def test_backend_rows_match_the_entry_points() -> None:
    tomllib = pytest.importorskip("tomllib")

    from aelastic.backends import BUILTINS

    project = tomllib.loads((_PACKAGE.parent / "pyproject.toml").read_text())["project"]
    backends = project["entry-points"]["aelastic.backends"]
    torchrun = project["entry-points"]["torchrun.handlers"]
    for info in BUILTINS:
        assert backends[info.name] == f"{info.module}:create_backend"
        assert torchrun[info.torchrun_alias].startswith("aelastic.integrations.torchrun:")
    assert set(backends) == {i.name for i in BUILTINS}
    assert set(torchrun) == {i.torchrun_alias for i in BUILTINS}


def test_the_pages_static_files_are_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((_PACKAGE.parent / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["aelastic"]
    static = sorted(p.name for p in (_PACKAGE / "web" / "static").iterdir())
    assert "web/static/*" in patterns and static
    assert {"app.js", "style.css", "page.html", "login.html", "message.html"} <= set(static)


def _sibling_imports(path: Path) -> set[str]:
    """The private modules of ``path``'s own folder that it imports (anywhere in the file)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return {name for name in found if (path.parent / f"{name}.py").exists()} - {"__init__"}


def _reaches(graph: dict[str, set[str]], start: str, goal: str, seen: set[str]) -> bool:
    for nxt in graph.get(start, set()) - seen:
        if nxt == goal or _reaches(graph, nxt, goal, seen | {nxt}):
            return True
    return False


@pytest.mark.parametrize(
    "folder",
    sorted(p.name for p in (_PACKAGE / "backends").iterdir() if (p / "__init__.py").exists()),
)
def test_a_backends_modules_import_each_other_one_way(folder: str) -> None:
    """The modules of a backend's folder form layers too: no two of them import each other,
    directly or through others, so each can be read on top of what it imports."""
    root = _PACKAGE / "backends" / folder
    for directory in sorted({p.parent for p in root.rglob("*.py")}):
        graph = {
            p.stem: _sibling_imports(p) for p in directory.glob("*.py") if p.stem != "__init__"
        }

        cycles = sorted(m for m in graph if _reaches(graph, m, m, set()))
        assert not cycles, f"{directory.relative_to(_PACKAGE)}: a cycle through {cycles}"


# -- the agent's shape: objects keep their state, modules import one way ------------------

#: Private names of the standard library (and of named tuples) that other objects offer.
_PUBLIC_PRIVATES = frozenset({"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make"})


def _reach_ins(path: Path) -> list[str]:
    """``obj._attr`` in ``path`` where ``obj`` is not the object itself (``self``/``cls``):
    another object's private state, read or written from outside it."""
    import ast

    tree = ast.parse(path.read_text())
    modules = {  # a module's own private names are its business, not an object's state
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in _PUBLIC_PRIVATES:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in modules):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
            continue
        found.append(f"{path.relative_to(_PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_agent_module_reaches_into_another_objects_private_state() -> None:
    """A function that takes an object and reads or sets its private attributes is that
    object's method in the wrong file: the agent's state lives in objects with their own
    methods, and every module uses them through those."""
    files = sorted((_PACKAGE / "agent").rglob("*.py"))
    found = [hit for path in files for hit in _reach_ins(path)]
    assert not found, "private state reached from outside its object:\n" + "\n".join(found)


def _package_imports(path: Path) -> set[str]:
    """The modules of the agent package that ``path`` imports, ``TYPE_CHECKING`` ones too,
    as dotted names relative to the package."""
    import ast

    root = _PACKAGE / "agent"
    here = path.relative_to(root).with_suffix("").parts
    package = list(here[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - node.level + 1] if node.level > 1 else package
        if node.level - 1 > len(package):
            continue  # above the agent package
        parts = [*base, *(node.module.split(".") if node.module else [])]
        targets = [parts] if node.module else [[*parts, a.name] for a in node.names]
        for target in targets:
            for cut in range(len(target), 0, -1):
                candidate = root.joinpath(*target[:cut])
                if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
                    found.add(".".join(target[:cut]))
                    break
    return found - {".".join(here)}


def test_the_agents_modules_import_each_other_one_way() -> None:
    """No circle of imports among the agent's modules, those under ``TYPE_CHECKING``
    included (a circle hidden there still means two modules that need each other)."""
    root = _PACKAGE / "agent"
    graph = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        graph[name.removesuffix(".__init__") or "__init__"] = _package_imports(path)
    packages = {n for n in graph if (root.joinpath(*n.split(".")) / "__init__.py").exists()}
    # A package's ``__init__`` re-exports its modules: importing it is not a circle with them.
    edges = {
        m: {t for t in ts if t not in packages or not m.startswith(t)} for m, ts in graph.items()
    }
    cycles = sorted(m for m in edges if m != "__init__" and _reaches(edges, m, m, set()))
    assert not cycles, f"agent: modules on a circle of imports: {cycles}"


def test_only_the_agents_top_level_uses_its_loop() -> None:
    """The rooms under the loop (processes, health, output) and the public modules beside it
    (api, events, prometheus) never import ``agent/loop``: the loop composes them."""
    root = _PACKAGE / "agent"
    users = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.relative_to(root).parts[0] not in ("loop", "__init__.py")
        and any(t == "loop" or t.startswith("loop.") for t in _package_imports(path))
    )
    assert not users, f"agent: modules that import the loop above them: {users}"
