"""torch's ``c10d`` rendezvous: one of the nodes hosts it (see :mod:`.hosted`)."""

from .hosted import create_c10d_backend as create_backend

__all__ = ["create_backend"]
