import os
import threading

import pytest
import torch

from pagekv.store import NodeConfig, StoreNode
from pagekv.store.launch import start_nodes

from .mooncake_fixture import mooncake_cluster


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # other workers' processes share the GPU
        why = "times the GPU: other pytest workers share it (gpu_check.sh runs it after -n)"
        alone = pytest.mark.skip(reason=why)
        for item in items:
            if "gpu_alone" in item.keywords:
                item.add_marker(alone)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh there)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def node():
    """A store node serving from a thread of this process on a free loopback port."""
    n = StoreNode(NodeConfig(port=0, capacity="256MiB"))
    t = threading.Thread(target=n.serve_forever, daemon=True)
    t.start()
    yield n
    n.stop()
    t.join(timeout=5)


@pytest.fixture
def three_nodes():
    """Three real `pagekv serve` processes on free loopback ports."""
    nodes = start_nodes(3, "--capacity", "256MiB")
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(scope="module")
def mooncake():
    """A Mooncake master and two store processes (256 MiB each) on loopback, TCP; skipped where
    Mooncake is not installed (see tests/mooncake_fixture.py)."""
    cluster = mooncake_cluster(stores=2, segment="256MiB")
    yield cluster
    cluster.stop()
