"""The ``pagekv`` command line (also ``python -m pagekv`` and ``python -m pagekv.store.cli``):
``serve`` and ``cluster`` run nodes, ``stats`` and ``ping`` ask them, ``keygen`` makes CURVE
keys. Settings: :mod:`.settings`; exit status 0 success, 1 a node failed, 2 bad usage."""

from .commands import main

__all__ = ["main"]
