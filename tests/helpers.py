"""Test helpers: fresh random bytes of any dtype, poisoning, bitwise comparison, waiting on a
condition, stopping a process for sure, a store client whose pages arrive when a test allows."""

import asyncio

import torch

from pagekv.connector import SUPPORTED_DTYPES

ALL_DTYPES = list(SUPPORTED_DTYPES.values())
_INT_VIEW = {1: (torch.uint8, 0xA5), 2: (torch.int16, -0x5A5B), 4: (torch.int32, -0x5A5A5A5B)}


def random_tensor(shape, dtype, device="cpu"):
    """Fresh random bytes of any dtype (fp8 included): all bit patterns, NaNs too."""
    size = dtype.itemsize
    n = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


def as_bits(t):
    """Integer view of the same bytes: compare with torch.equal, NaNs and all."""
    return t.view(_INT_VIEW[t.element_size()][0])


def poison_(t):
    """Fill every element with the byte 0xA5 (never zeros) so unwritten elements show."""
    dtype, value = _INT_VIEW[t.element_size()]
    t.view(dtype).fill_(value)
    return t


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(as_bits(a).cpu(), as_bits(b).cpu())


def wait_until(predicate, timeout=10.0, what="condition"):
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def store_blocks(config, keys: list, values: list) -> None:
    """PUT ``values`` under ``keys`` through a client of its own, placed by ``config`` (its
    nodes, replicas) but waiting a loaded machine's 10 s: a test whose client times out within
    a second for what it checks starts from blocks really stored where they belong (a setup
    PUT given that short timeout failed over to another node, or failed, under load)."""
    import dataclasses

    from pagekv.store import Status, StoreClient

    patient = dataclasses.replace(config, timeout_s=10.0, connect_timeout_s=None)
    with StoreClient(patient.endpoints, config=patient) as client:
        assert client.put_many(keys, values) == [Status.OK] * len(keys)


def sigstop(pid: int, timeout: float = 5.0) -> None:
    """Stop process ``pid`` and return once every one of its threads is stopped (a node's bulk
    lane answering on a warm connection could otherwise still answer): see
    :func:`pagekv.store.launch.stop_process`."""
    from pagekv.store.launch import stop_process

    stop_process(pid, timeout)


class GatedStore:
    """The connector's store client with each fetched page's arrival held back until the test
    allows it: the bytes land at once, the pages are published (key order) one by one as
    allowed. ``allow(n)``: the first ``n`` arrivals may go (any thread)."""

    def __init__(self, conn, allowed=0):
        self.store, self.loop = conn.store, conn._loop.loop
        self.allowed, self.arrived, self.calls = allowed, 0, 0
        self._changed = asyncio.Event()
        conn.fetcher.store = self

    def allow(self, n):
        def update():
            self.allowed = n
            self._changed.set()

        self.loop.call_soon_threadsafe(update)

    async def get_many(self, keys, into=None, on_arrival=None):
        self.calls += 1
        got = []
        result = await self.store.get_many(keys, into=into, on_arrival=got.append)
        for i in sorted(got):
            while self.arrived >= self.allowed:
                self._changed.clear()
                await self._changed.wait()
            self.arrived += 1
            on_arrival(i)
        return result


POISON = 0xA5  # a store test's destination bytes before a get


def poisoned_like(value) -> object:
    """Destination buffers for a value (bytes, or a list of frames), filled with POISON."""
    if isinstance(value, list):
        return [bytearray([POISON]) * len(f) for f in value]
    return bytearray([POISON]) * len(value)


def as_bytes(value) -> object:
    """A value (one buffer or a list of frames) as bytes, for comparison."""
    return [bytes(f) for f in value] if isinstance(value, list) else bytes(value)


def kv_caches(geo, slots: int, device: str, poisoned: bool = False) -> list:
    """An engine's K and V caches, layer-first ``[layers, slots, *device_layer_shape]``: fresh
    random bits, or poisoned (a destination before a load)."""
    shape = (geo.num_layers, slots, *geo.device_layer_shape)
    if poisoned:
        return [poison_(torch.empty(shape, dtype=geo.dtype, device=device)) for _ in range(2)]
    return [random_tensor(shape, geo.dtype, device) for _ in range(2)]


class StreamGate:
    """Holds a CUDA stream back until :meth:`open` (or the end of a ``with`` block): the stream
    waits (``cuStreamWaitValue32``, the driver API) for a flag in pinned host memory that
    :meth:`open` sets with a plain store from the host. Unlike a timed hold
    (``torch.cuda._sleep``), nothing queued behind it runs before the test says so, however slow
    the host is at that moment (parallel workers). The flag is set from the host, not by a GPU
    write on another stream: streams share the device's few hardware queues, and a write queued
    behind the wait on the same queue would never run (a hang seen on an H100)."""

    def __init__(self, stream):
        import ctypes

        driver = ctypes.CDLL("libcuda.so.1")
        wait = getattr(driver, "cuStreamWaitValue32_v2", None) or driver.cuStreamWaitValue32
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        # pinned host memory is mapped at the same address on the device (unified addressing)
        self.flag = torch.zeros(1, dtype=torch.int32).pin_memory()
        rc = wait(stream.cuda_stream, self.flag.data_ptr(), 1, 0)  # 0: CU_STREAM_WAIT_VALUE_GEQ
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {rc}")
        self.is_open = False

    def open(self):
        if not self.is_open:
            self.flag[0] = 1
            self.is_open = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.open()
