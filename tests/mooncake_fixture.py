"""A Mooncake Store for tests: a master and store processes on loopback (TCP), started from the
Mooncake package this interpreter imports. Where Mooncake is not installed the tests that ask
for it skip, unless ``PAGEKV_REQUIRE_MOONCAKE=1`` (``make test-mooncake``, ``make test-vllm``,
``make test-sglang``): then they fail."""

from __future__ import annotations

import importlib.util

import pytest

from pagekv.env import REQUIRE_MOONCAKE


def have_mooncake() -> bool:
    return importlib.util.find_spec("mooncake") is not None


def mooncake_cluster(**kwargs):
    """A started :class:`MooncakeCluster` (stop it), or a skip/failure saying why not."""
    if not have_mooncake():
        if REQUIRE_MOONCAKE.get():
            pytest.fail("PAGEKV_REQUIRE_MOONCAKE=1 but Mooncake is not installed")
        pytest.skip("Mooncake Store is not installed here: make test-mooncake")
    from pagekv.store.mooncake.launch import MooncakeCluster

    return MooncakeCluster(**kwargs)
