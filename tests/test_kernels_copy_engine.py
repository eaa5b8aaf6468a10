"""The copy-engine backend and the measured backend table, on CPU: the setting, the table's
choice and cache, the descriptors' arguments, and the fallback to the kernel when the driver
refuses a call (a stand-in library)."""

import json
import logging
import math

import pytest
import torch

from pagekv.connector import HostPagePool, KVGeometry
from pagekv.kernels import DeviceKV, copy_engine, copy_table, jit, load, save
from pagekv.kernels.copy_table import CopyTable, Entry, Shape
from pagekv.kernels.layout import mean_run_bytes

INF = math.inf


def entry(load, all_layers, run, total, kernel, ce, direct=INF):
    return Entry(Shape(load, all_layers, float(run), total),
                 (("kernel", kernel), ("copy_engine", ce), ("direct", direct)))  # fmt: skip


TABLE = CopyTable("k", "GPU", (
    entry(True, True, 4096, 16 << 20, kernel=1.0, ce=2.0),  # small runs: the kernel
    entry(True, True, 32768, 16 << 20, kernel=1.0, ce=1.08),  # within the slack: copy engine
    entry(True, True, 131072, 16 << 20, kernel=1.0, ce=0.9, direct=0.5),  # direct fastest
    entry(False, True, 4096, 16 << 20, kernel=1.0, ce=0.95),
    entry(True, False, 32768, 1 << 20, kernel=1.0, ce=1.5),
    entry(True, False, 32768, 16 << 20, kernel=1.0, ce=1.0),
))  # fmt: skip
ALL = ("kernel", "copy_engine", "direct")


def test_setting(monkeypatch):
    monkeypatch.delenv("PAGEKV_COPY_BACKEND", raising=False)
    assert jit.copy_backend_setting() == "auto"
    for value in ("kernel", "COPY_ENGINE", " direct ", "torch", "auto"):
        monkeypatch.setenv("PAGEKV_COPY_BACKEND", value)
        assert jit.copy_backend_setting() == value.strip().lower()
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "dma")
    with pytest.raises(ValueError, match="PAGEKV_COPY_BACKEND"):
        jit.copy_backend_setting()


def test_choice_measured_run_at_or_below_and_slack():
    def pick(load=True, all_layers=True, run=4096, total=16 << 20, allowed=ALL):
        return TABLE.choose(Shape(load, all_layers, run, total), allowed)

    assert pick(run=4096) == "kernel"
    assert pick(run=3000) == "kernel"  # none measured at or below: the nearest, 4096
    assert pick(run=32768) == "copy_engine"  # 8% slower, within COPY_ENGINE_SLACK
    # the nearest measured run at or below: 4096, not the nearer 32768 (1-D copies slow down
    # steeply below ~28 KiB, so a run between two entries gets the shorter run's choice)
    assert pick(run=30000) == "kernel"
    assert pick(run=40000) == "copy_engine"
    assert pick(run=1 << 20) == "direct"
    assert pick(run=1 << 20, allowed=("kernel", "copy_engine")) == "copy_engine"
    assert pick(run=32768, allowed=("kernel", "direct")) == "kernel"  # copy engine failed
    assert pick(load=False, run=512) == "copy_engine"  # the only save entry
    assert pick(all_layers=False, run=32768, total=1 << 20) == "kernel"
    assert pick(all_layers=False, run=32768, total=64 << 20) == "copy_engine"
    # the nearest entry with nothing allowed measured: the next one
    assert pick(run=4096, allowed=("direct",)) == "direct"
    assert CopyTable("k", "GPU", ()).choose(Shape(True, True, 1, 1), ALL) == "kernel"


def test_slack_is_relative_to_the_fastest():
    e = entry(True, True, 1, 1, kernel=1.0, ce=1.0 + copy_table.COPY_ENGINE_SLACK * 1.01)
    assert e.best(ALL) == "kernel"
    e = entry(True, True, 1, 1, kernel=1.0, ce=1.0 + copy_table.COPY_ENGINE_SLACK * 0.99)
    assert e.best(ALL) == "copy_engine"
    assert entry(True, True, 1, 1, kernel=INF, ce=INF).best(ALL) is None


def test_table_cache_round_trip_key_and_bad_files(tmp_path, caplog):
    path = copy_table.table_path(tmp_path, "k")
    copy_table.save_table(path, TABLE)
    assert copy_table.load_table(path, "k") == TABLE
    assert copy_table.load_table(path, "other") is None  # another GPU, driver or library
    doc = json.loads(path.read_text())
    doc["version"] = copy_table.TABLE_VERSION + 1
    path.write_text(json.dumps(doc))
    assert copy_table.load_table(path, "k") is None
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        assert copy_table.load_table(path, "k") is None
    assert "ignoring copy table" in caplog.text
    assert copy_table.load_table(tmp_path / "missing.json", "k") is None


def test_measured_once_then_read_from_the_cache(tmp_path):
    path = copy_table.table_path(tmp_path / "cache", "k")
    calls = []

    def measure():
        calls.append(1)
        return TABLE

    assert copy_table.cached_or_measured(path, "k", measure) == (TABLE, True)
    assert copy_table.cached_or_measured(path, "k", measure) == (TABLE, False)
    assert len(calls) == 1
    key_b = "other"
    table_b = CopyTable(key_b, "GPU", TABLE.entries[:1])
    path_b = copy_table.table_path(tmp_path / "cache", key_b)
    assert copy_table.cached_or_measured(path_b, key_b, lambda: table_b) == (table_b, True)
    assert copy_table.load_table(path, "k") == TABLE  # one file per key


def test_a_failed_measurement_leaves_auto_on_the_kernel_and_nothing_cached(tmp_path, caplog):
    path = copy_table.table_path(tmp_path / "cache", "k")

    def measure():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        table, fresh = copy_table.measured_or_empty(path, "k", "GPU", measure)
    assert not fresh and table.entries == ()
    assert table.choose(Shape(True, True, 32768, 16 << 20), ALL) == "kernel"
    assert not path.exists()
    assert ["out of memory" in r.getMessage() for r in caplog.records] == [True]
    assert copy_table.measured_or_empty(path, "k", "GPU", lambda: TABLE) == (TABLE, True)


def test_table_key_names_device_driver_and_library():
    base = copy_table.table_key("H100", 13000, "libpagekv_a.so")
    assert base == copy_table.table_key("H100", 13000, "libpagekv_a.so")
    assert len({base, copy_table.table_key("H200", 13000, "libpagekv_a.so"),
                copy_table.table_key("H100", 12080, "libpagekv_a.so"),
                copy_table.table_key("H100", 13000, "libpagekv_b.so")}) == 4  # fmt: skip


def test_grid_covers_both_directions_and_spans():
    shapes = list(copy_table.grid())
    assert (
        len(shapes)
        == len(set(shapes))
        == 2 * 2 * len(copy_table.RUN_BYTES) * len(copy_table.TOTAL_BYTES)
    )
    assert {(s[0], s[1]) for s in shapes} == {(a, b) for a in (True, False) for b in (True, False)}


# ---- descriptors ----------------------------------------------------------------------------
GEO = KVGeometry(4, 16, 2, 64, "bf16")  # 256-byte rows, 4 KiB per page run
ROW = GEO.row_elems


def test_mean_run_bytes():
    both = torch.empty(2, GEO.num_layers, 100, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, both[0], both[1])
    slots = torch.arange(32).view(2, 16)
    assert mean_run_bytes(kv, slots) == 16 * GEO.item_bytes
    slots[0, 8] = -1  # splits page 0's run: 3 runs of 31 tokens
    assert mean_run_bytes(kv, slots) == 31 * GEO.item_bytes / 3
    slots[1] = torch.arange(65, 49, -1)  # descending: 16 runs of one token
    assert mean_run_bytes(kv, slots) == 31 * GEO.item_bytes / 18
    strided = torch.empty(GEO.num_layers, 100, 2, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, strided[:, :, 0], strided[:, :, 1])
    assert mean_run_bytes(kv, torch.arange(32).view(2, 16)) == GEO.item_bytes  # 1-token runs


# ---- fallback when the driver refuses a call -------------------------------------------------
class RefusingLib:
    """Stands in for the library: every batched copy is refused with cudaErrorInvalidValue."""

    def __init__(self):
        self.calls = []

    def pagekv_ce_page_transfer(self, *args):
        self.calls.append(args)
        return 1


def test_refused_call_is_logged_once_and_the_device_stops_using_it(monkeypatch, caplog):
    monkeypatch.setattr(copy_engine, "_failed", {})
    monkeypatch.setattr(copy_engine, "_support", lambda device: 13000)
    assert copy_engine.supported(0) and copy_engine.disabled_reason(0) is None
    both = torch.empty(2, GEO.num_layers, 100, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, both[0], both[1])
    pool = HostPagePool(GEO, 4, pin=False)
    ids, slots = torch.tensor([1, 3]), torch.arange(32).view(2, 16)
    lib = RefusingLib()
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        for _ in range(3):
            assert not copy_engine.page_transfer(lib, True, pool.buffer, kv, ids, slots, 0, 4, 0)
    lines = [r for r in caplog.records if "copy-engine" in r.getMessage()]
    assert len(lines) == 1 and "cudaError 1" in lines[0].getMessage()
    assert "use the kernel" in lines[0].getMessage()
    assert not copy_engine.supported(0) and "cudaError 1" in copy_engine.disabled_reason(0)
    assert copy_engine.supported(1)  # another device keeps it
    args = lib.calls[0]
    assert args[15:20] == (0, 4, copy_engine.FLAGS, copy_engine.LANES, copy_engine.MAX_OPS)


def test_unsupported_library_or_driver(monkeypatch):
    monkeypatch.setattr(copy_engine, "_failed", {})
    monkeypatch.setattr(copy_engine, "_support", lambda device: 0)
    assert not copy_engine.supported(0)
    assert "12.8" in copy_engine.disabled_reason(0)


def test_copy_engine_backend_on_cpu_tensors_is_an_error_and_auto_is_torch(monkeypatch):
    kv = DeviceKV.from_caches(GEO, *(torch.zeros(4, 32, 2, 64, dtype=torch.bfloat16),) * 2)
    pool = HostPagePool(GEO, 2, pin=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        load(pool.buffer, [0], kv, torch.arange(16), backend="copy_engine")
    with pytest.raises(ValueError, match="needs CUDA"):
        save(kv, torch.arange(16), pool.buffer, [0], backend="copy_engine")
    for setting in ("copy_engine", "kernel", "direct"):
        monkeypatch.setenv("PAGEKV_COPY_BACKEND", setting)
        assert load(pool.buffer, [0], kv, torch.arange(16)) == "torch"  # no GPU: the reference
