"""Mooncake Store as a pagekv store backend (``mooncake://`` addresses; the optional extra
``pagekv[mooncake]``). :mod:`.config` parses addresses without Mooncake installed;
:mod:`.backend` is the adapter, :mod:`.handle` the process's Mooncake client, :mod:`.values` the
object layout and its checksum trailer."""

from .config import MooncakeConfig

__all__ = ["MooncakeConfig"]
