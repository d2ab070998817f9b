"""torch's ``static`` rendezvous: one of the nodes hosts it (see :mod:`.hosted`)."""

from .hosted import create_static_backend as create_backend

__all__ = ["create_backend"]
