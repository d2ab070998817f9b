"""aelastic's worker bootstrap, run by Python's ``site`` module when a worker starts.

How it works: the agent puts this file's directory first on the worker's ``PYTHONPATH``, so
Python imports this ``sitecustomize`` at startup, before the user's script, whatever the
command (``python script.py``, ``python -m``, a warm standby, a callable's interpreter, a
shell wrapper that starts Python): the script's argv, ``sys.path[0]`` and ``ps`` stay as a
plain start leaves them. It loads the progress runtime (``_aelastic_worker.py``, standard
library only), installs torch's optimizer hook and maps the worker's progress page (its
stacks can be taken from its start), loads the guards (``_aelastic_guard.py``: the error-
file hook, which also tells the agent a worker is failing, the watch of the worker's agent:
a worker whose agent froze stops by itself, and the exit hook: a gloo group left alive is
destroyed before the interpreter's finalization), then removes its directory from
``sys.path`` and ``PYTHONPATH`` (the worker's own subprocesses start plain) and runs the
``sitecustomize`` it shadowed, if there is one. It never raises: a worker starts even if the
bootstrap cannot.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__: list[str] = []


def _load(here: str, name: str) -> ModuleType | None:
    """The module ``name`` of this directory, loaded once under that name."""
    if name in sys.modules:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(here, name + ".py"))
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _bootstrap() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        runtime = _load(here, "_aelastic_worker")
        if runtime is not None:
            runtime.install_torch_hook()
            runtime.start()
    except Exception:
        sys.modules.pop("_aelastic_worker", None)
    try:
        guard = _load(here, "_aelastic_guard")
        if guard is not None:
            guard.install_excepthook()
            guard.watch_agent()
            guard.install_exit_hook()
    except Exception:
        sys.modules.pop("_aelastic_guard", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in entries if p and os.path.abspath(p) != here]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the shadowed one
    except ImportError:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    except Exception:  # the other one failed: as site.py would, say so and go on
        import traceback

        traceback.print_exc()


_bootstrap()
