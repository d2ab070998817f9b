"""The worker bootstrap's directory: put first on a worker's ``PYTHONPATH`` by the agent.

It holds ``sitecustomize.py`` (run by Python's ``site`` module at the worker's start) and
``_aelastic_worker.py`` (the progress runtime it loads). Nothing here is imported by name
from the ``aelastic`` package except the runtime's constants (see :mod:`aelastic.worker`).
"""
