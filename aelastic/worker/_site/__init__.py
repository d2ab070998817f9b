"""The worker bootstrap's directory: put first on a worker's ``PYTHONPATH`` by the agent.

It holds ``sitecustomize.py`` (run by Python's ``site`` module at the worker's start),
``_aelastic_worker.py`` (the progress runtime it loads) and ``_aelastic_guard.py`` (the
worker's guards: its agent's beat, its error file). Nothing here is imported by name from
the ``aelastic`` package except the runtime's constants (see :mod:`aelastic.worker`).
"""
