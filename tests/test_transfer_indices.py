"""Which indices the connector hands to a transfer, on CPU: host-side backends (copy engine,
direct) get the CPU page ids and slots as they are, with no upload; the kernel gets uploaded
ones; an engine's CUDA slot table is never read on the host (a stand-in staging ring and
backend choice stand for the GPU)."""

import pytest
import torch

from pagekv.connector import KVGeometry, transfer_indices
from pagekv.connector.transfer_indices import HOST_INDEX_BACKENDS, Indices
from pagekv.kernels import DeviceKV, choose_backend
from tests.helpers import kv_caches

GEO = KVGeometry(2, 4, 2, 8, "fp32")


class Staging:
    """Records uploads; "uploads" to a tensor marked by a distinct storage (a clone)."""

    def __init__(self):
        self.uploads = []

    def upload(self, values, device):
        self.uploads.append(values.clone())
        return values.clone()


def kv():
    return DeviceKV.from_caches(GEO, *kv_caches(GEO, 64, "cpu"))


@pytest.mark.parametrize("choice", HOST_INDEX_BACKENDS)
def test_host_side_backends_get_the_cpu_indices_without_upload(monkeypatch, choice):
    asked = []

    def choose(load, kv, ids, slots, *, layer=None, deferred=False):
        asked.append((load, ids.tolist(), slots.tolist(), layer, deferred))
        return choice

    monkeypatch.setattr(transfer_indices, "choose_backend", choose)
    staging = Staging()
    slots = torch.arange(8, dtype=torch.int64).view(2, 4)
    idx = transfer_indices.transfer_indices(True, kv(), [5, 3], slots, staging, layer=1,
                                            deferred=True)  # fmt: skip
    assert idx == Indices(idx.ids, idx.slots, choice)
    assert idx.ids.tolist() == [5, 3] and idx.ids.dtype == torch.int64
    assert torch.equal(idx.slots, slots) and not idx.on_device
    assert staging.uploads == []
    assert asked == [(True, [5, 3], slots.tolist(), 1, True)]


@pytest.mark.parametrize("choice", ["kernel", "torch"])
def test_kernel_gets_uploaded_indices_and_auto(monkeypatch, choice):
    monkeypatch.setattr(transfer_indices, "choose_backend", lambda *a, **k: choice)
    staging = Staging()
    slots = torch.arange(8, dtype=torch.int64).view(2, 4).flip(0)
    idx = transfer_indices.transfer_indices(False, kv(), [1, 0], slots, staging)
    assert idx.backend == "auto"
    assert [u.tolist() for u in staging.uploads] == [slots.tolist(), [1, 0]]
    assert torch.equal(idx.slots, slots) and idx.ids.tolist() == [1, 0]


def test_a_device_slot_table_is_never_read_on_the_host(monkeypatch):
    """A CUDA table (the engine's tensor) goes to the kernel as it is: asking the table would
    read it on the host, a device sync."""

    class CudaLike(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    def choose(*a, **k):
        raise AssertionError("choose_backend read a device slot table")

    monkeypatch.setattr(transfer_indices, "choose_backend", choose)
    staging = Staging()
    slots = torch.arange(8, dtype=torch.int64).view(2, 4).as_subclass(CudaLike)
    idx = transfer_indices.transfer_indices(True, kv(), [0, 1], slots, staging)
    assert idx.backend == "auto" and idx.slots is slots
    assert [u.tolist() for u in staging.uploads] == [[0, 1]]


def test_choose_backend_off_cuda_is_torch():
    assert choose_backend(True, kv(), [0], torch.zeros(1, 4, dtype=torch.int64)) == "torch"
    assert choose_backend(False, kv(), torch.tensor([0]), [0, 1, 2, 3], layer=0) == "torch"


def test_choose_backend_checks_shapes():
    with pytest.raises(ValueError, match="slots has shape"):
        choose_backend(True, kv(), [0, 1], torch.zeros(1, 4, dtype=torch.int64))


@pytest.mark.parametrize("n", [0, 1, 7, 4096])
def test_host_ids_are_the_values_as_int64(n):
    import random

    rng = random.Random(n)
    values = [rng.randrange(-(2**63), 2**63) for _ in range(n)]
    got = transfer_indices.host_ids(values)
    assert got.dtype == torch.int64 and got.device.type == "cpu" and got.shape == (n,)
    assert got.tolist() == values
    assert torch.equal(transfer_indices.host_ids(tuple(values)), got)


@pytest.mark.parametrize("bad", [[1, 2**63], [1.5], ["3"]])
def test_host_ids_refuse_what_is_not_a_64_bit_int(bad):
    with pytest.raises((OverflowError, TypeError)):
        transfer_indices.host_ids(bad)
