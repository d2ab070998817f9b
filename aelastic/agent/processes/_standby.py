"""A warm standby: an idle interpreter that becomes a worker when its agent says so.

How it works: the agent runs ``python [flags] .../aelastic/agent/_standby.py FD`` as a
script, so that ``ps`` shows one short line and nothing of the ``aelastic`` package gets
imported (the worker must find the interpreter as a cold start leaves it). The standby takes
its own directory off ``sys.path``, imports the modules listed in its optional second
argument (``torch``: a spare's workers are ready but for their ranks; with it
``torch._dynamo``, which torch's first optimizer imports, seconds on a loaded machine; an
import that fails is left for the script to fail), and blocks on the Unix socket ``FD``
until the agent sends one message: the worker's full environment, its argv, and descriptors
for stdout and stderr (SCM_RIGHTS). It applies them (the bootstrap's runtime, loaded at its
start, then maps the progress page and watches the agent's beat page that the environment
names), empties ``__main__``
and runs the script there as ``python script.py`` would (``sys.path[0]``, ``__file__``,
``sys.argv``), or the module as ``python -m`` does. End-of-file on the socket (the agent
closed it, or is gone) makes it exit 0. Everything happens inside one function with local
imports, so that emptying ``__main__`` leaves nothing of the standby behind but the few
standard modules it imported. An uncaught error of the worker is printed as Python prints
it, without the standby's frames.
"""


def _serve() -> None:
    import json
    import os
    import socket
    import sys

    safe_path = getattr(sys.flags, "safe_path", False)  # -P / PYTHONSAFEPATH (3.11)
    if not safe_path:
        del sys.path[0]  # this file's directory: the worker's own entry comes at release
    ctl = socket.socket(fileno=int(sys.argv[1]))
    for name in filter(None, (sys.argv[2] if len(sys.argv) > 2 else "").split(",")):
        # torch's first optimizer imports torch._dynamo (and sympy): seconds, done now too
        for module in (name, "torch._dynamo") if name == "torch" else (name,):
            try:  # noqa: SIM105 - nothing more imported than the preload itself
                __import__(module)
            except Exception:  # the script's own import of it shows the error
                pass
    try:
        msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 22, 2)
    except OSError:
        os._exit(0)
    if not msg:
        os._exit(0)  # the agent closed the socket, or is gone
    ctl.close()
    job = json.loads(msg)
    for target, fd in zip(job["dup"], fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    for key in job["unset"]:
        os.environ.pop(key, None)
    os.environ.update(job["env"])
    runtime = sys.modules.get("_aelastic_worker")  # the bootstrap's, loaded at the start
    if runtime is not None:
        runtime.start()  # the progress page came with the worker's environment
    guard = sys.modules.get("_aelastic_guard")
    if guard is not None:
        guard.watch_agent()  # and the beat page
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if not n.startswith("__")]:
        del main[name]
    if job["module"] is not None:
        import runpy

        sys.argv[:] = [job["module"], *job["args"]]
        if not safe_path:
            sys.path.insert(0, os.getcwd())
        runpy._run_module_as_main(job["module"])  # type: ignore[attr-defined]
        return
    path = job["script"]
    sys.argv[:] = [path, *job["args"]]
    is_file = os.path.isfile(path)
    if is_file and not safe_path:
        sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    if not is_file or not path.endswith((".py", ".pyw")):
        import runpy

        runpy.run_path(path, run_name="__main__")
        return
    import io
    from importlib.machinery import SourceFileLoader

    full = os.path.abspath(path)
    with io.open_code(full) as f:
        code = compile(f.read(), full, "exec")
    main.update(
        __name__="__main__",
        __file__=full,
        __cached__=None,
        __doc__=None,
        __package__=None,
        __spec__=None,
        __loader__=SourceFileLoader("__main__", full),
    )
    exec(code, main)


if __name__ == "__main__":
    try:
        _serve()
    except BaseException as _exc:
        # The worker's own uncaught error, shown and ended as Python does for a script, but
        # without this file's frames (``__main__`` is the worker's now: local names only).
        import sys as _sys

        if isinstance(_exc, SystemExit):
            raise
        _here = _sys._getframe().f_code.co_filename
        _tb = _exc.__traceback__
        while _tb is not None and _tb.tb_frame.f_code.co_filename == _here:
            _tb = _tb.tb_next
        _sys.excepthook(type(_exc), _exc.with_traceback(_tb), _tb)
        if not isinstance(_exc, KeyboardInterrupt):
            _sys.exit(1)
        import atexit as _atexit
        import os as _os
        import signal as _signal

        _atexit._run_exitfuncs()
        _sys.stdout.flush()
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
        _os.kill(_os.getpid(), _signal.SIGINT)  # killed by SIGINT, as Python ends then
