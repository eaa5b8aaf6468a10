"""The copy-engine backend and the measured backend table, on CPU: the setting, the table's
choice and cache, the descriptors' arguments, and the fallback to the kernel when the driver
refuses a call (a stand-in library)."""

import fcntl
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagekv.connector import HostPagePool, KVGeometry
from pagekv.kernels import (
    DeviceKV,
    _calibrate,
    copy_engine,
    copy_table,
    jit,
    layout,
    load,
    ops,
    save,
    staged,
)
from pagekv.kernels.copy_table import CopyTable, Entry, Shape

INF = math.inf


def entry(load, all_layers, run, total, kernel, ce, direct=INF, host=(1e-5, 1e-5, 1e-5)):
    """A measured shape: completion seconds, and host seconds of the call (kernel, copy engine,
    direct)."""
    return Entry(Shape(load, all_layers, float(run), total),
                 (("kernel", kernel), ("copy_engine", ce), ("direct", direct)),
                 tuple(zip(("kernel", "copy_engine", "direct"), host)))  # fmt: skip


TABLE = CopyTable("k", "GPU", (
    entry(True, True, 4096, 16 << 20, kernel=1.0, ce=2.0),  # small runs: the kernel
    entry(True, True, 32768, 16 << 20, kernel=1.0, ce=1.08),  # within the slack: copy engine
    entry(True, True, 36864, 16 << 20, kernel=1.0, ce=1.3),  # a longer run, yet slower
    entry(True, True, 131072, 16 << 20, kernel=1.0, ce=0.9),
    entry(True, True, 262144, 16 << 20, kernel=1.0, ce=0.9, direct=0.5),  # direct fastest
    entry(False, True, 4096, 16 << 20, kernel=1.0, ce=0.95),
    entry(True, False, 32768, 1 << 20, kernel=1.0, ce=1.5),
    entry(True, False, 32768, 16 << 20, kernel=1.0, ce=1.0),
    entry(True, False, 32768, 128 << 20, kernel=1.0, ce=1.0),
))  # fmt: skip
ALL = ("kernel", "copy_engine", "direct")


def pick(load=True, all_layers=True, run=4096, total=16 << 20, allowed=ALL, table=TABLE):
    return table.choose(Shape(load, all_layers, run, total), allowed)


def test_setting_defaults_to_auto(monkeypatch):
    monkeypatch.delenv("PAGEKV_COPY_BACKEND", raising=False)
    assert jit.copy_backend_setting() == "auto"
    for value in ("auto", "COPY_ENGINE", " direct ", "torch", "kernel", "split"):
        monkeypatch.setenv("PAGEKV_COPY_BACKEND", value)
        assert jit.copy_backend_setting() == value.strip().lower()
    monkeypatch.setenv("PAGEKV_COPY_BACKEND", "dma")
    with pytest.raises(ValueError, match="PAGEKV_COPY_BACKEND"):
        jit.copy_backend_setting()


def test_choice_at_measured_runs_and_slack():
    assert pick(run=4096) == "kernel"
    assert pick(run=32768) == "copy_engine"  # 8% slower, within COPY_ENGINE_SLACK
    assert pick(run=36864) == "kernel"  # measured there: no interpolation from 32 KiB
    assert pick(run=131072) == "copy_engine"
    assert pick(run=1 << 20) == "direct"  # above the grid: its longest run
    assert pick(run=1 << 20, allowed=("kernel", "copy_engine")) == "copy_engine"
    assert pick(run=32768, allowed=("kernel", "direct")) == "kernel"  # copy engine failed
    assert pick(load=False, run=4096) == "copy_engine"  # saves are chosen on their own
    assert pick(all_layers=False, run=32768, total=1 << 20) == "kernel"
    assert pick(all_layers=False, run=32768, total=64 << 20) == "copy_engine"
    assert pick(run=4096, allowed=("direct",)) == "kernel"  # nothing allowed measured
    assert CopyTable("k", "GPU", ()).choose(Shape(True, True, 1, 1), ALL) == "kernel"


def test_a_shape_between_entries_needs_both_sides_to_agree():
    assert pick(run=20000) == "kernel"  # 4 KiB says kernel, 32 KiB copy engine
    assert pick(run=34000) == "kernel"  # 32 KiB says copy engine, 36 KiB kernel
    assert pick(run=50000) == "kernel"  # 36 KiB kernel, 128 KiB copy engine
    assert pick(run=200000) == "kernel"  # 128 KiB copy engine, 256 KiB direct
    # totals too: 1 MiB says kernel, 16 MiB copy engine
    assert pick(all_layers=False, run=32768, total=4 << 20) == "kernel"
    assert pick(all_layers=False, run=32768, total=32 << 20) == "copy_engine"
    assert pick(run=3000) == "kernel"  # shorter than every measured run
    assert pick(load=False, run=3000) == "kernel"


def test_a_backend_that_holds_the_host_longer_than_the_kernel_is_never_chosen():
    slack = copy_table.ENQUEUE_SLACK_S
    fast_but_blocking = entry(True, True, 1, 1, kernel=1.0, ce=0.5, direct=0.4,
                              host=(1e-5, 1e-5 + slack * 1.1, 1e-5 + slack * 1.1))  # fmt: skip
    assert fast_but_blocking.best(ALL) == "kernel"
    within = entry(True, True, 1, 1, kernel=1.0, ce=0.5, direct=0.4,
                   host=(1e-5, 1e-5 + slack * 0.9, 1e-3))  # fmt: skip
    assert within.best(ALL) == "copy_engine"
    # enqueued by the connector's issuer thread: the copy engine's host time is not the caller's
    assert fast_but_blocking.best(ALL, deferred=True) == "copy_engine"
    assert fast_but_blocking.best(("kernel", "direct"), deferred=True) == "kernel"  # direct: no
    assert TABLE.choose(fast_but_blocking.shape, ALL) == "kernel"
    deferred = CopyTable("k", "GPU", (fast_but_blocking,))
    assert deferred.choose(fast_but_blocking.shape, ALL, deferred=True) == "copy_engine"
    assert deferred.choose(fast_but_blocking.shape, ALL) == "kernel"  # remembered apart
    unmeasured_host = Entry(Shape(True, True, 1.0, 1), (("kernel", 1.0), ("copy_engine", 0.5)),
                            (("kernel", 1e-5),))  # fmt: skip
    assert unmeasured_host.best(ALL) == "kernel"


def test_slack_is_relative_to_the_fastest():
    e = entry(True, True, 1, 1, kernel=1.0, ce=1.0 + copy_table.COPY_ENGINE_SLACK * 1.01)
    assert e.best(ALL) == "kernel"
    e = entry(True, True, 1, 1, kernel=1.0, ce=1.0 + copy_table.COPY_ENGINE_SLACK * 0.99)
    assert e.best(ALL) == "copy_engine"
    assert entry(True, True, 1, 1, kernel=INF, ce=INF).best(ALL) is None


def test_deferred_transfers_take_the_copy_engine_with_a_wider_slack():
    """Enqueued by the connector's issuer (beside the engine's compute), the copy engine is
    taken unless more than DEFERRED_COPY_ENGINE_SLACK slower; on the caller's thread the narrow
    slack holds."""
    wide = copy_table.DEFERRED_COPY_ENGINE_SLACK
    assert wide > copy_table.COPY_ENGINE_SLACK
    within = entry(True, True, 1, 1, kernel=1.0, ce=1.0 + wide * 0.99)
    assert within.best(ALL, deferred=True) == "copy_engine" and within.best(ALL) == "kernel"
    beyond = entry(True, True, 1, 1, kernel=1.0, ce=1.0 + wide * 1.01)
    assert beyond.best(ALL, deferred=True) == "kernel"


def test_one_layer_deferred_transfers_take_the_copy_engine_with_a_wider_slack_still():
    """One layer through the issuer: the copy engine unless more than DEFERRED_LAYER_SLACK
    slower (the one-layer kernel costs a decode more than the all-layer one does); all layers
    keep DEFERRED_COPY_ENGINE_SLACK, the caller's thread COPY_ENGINE_SLACK."""
    layer = copy_table.DEFERRED_LAYER_SLACK
    assert layer > copy_table.DEFERRED_COPY_ENGINE_SLACK
    ce = 1.0 + (layer + copy_table.DEFERRED_COPY_ENGINE_SLACK) / 2
    assert entry(True, False, 1, 1, kernel=1.0, ce=ce).best(ALL, deferred=True) == "copy_engine"
    assert entry(True, False, 1, 1, kernel=1.0, ce=ce).best(ALL) == "kernel"
    assert entry(True, True, 1, 1, kernel=1.0, ce=ce).best(ALL, deferred=True) == "kernel"
    beyond = entry(False, False, 1, 1, kernel=1.0, ce=1.0 + layer * 1.01)
    assert beyond.best(ALL, deferred=True) == "kernel"


def test_the_faster_dma_backend_is_preferred_within_the_slack():
    """The pitched copy and the copy engine both leave the SMs alone: the faster of them is
    taken unless more than the slack slower than the fastest; on the caller's thread only where
    its host time is within the kernel's, through the issuer whatever it is."""

    def e(kernel, ce, pitched, host_pitched=1e-5):
        seconds = (("kernel", kernel), ("copy_engine", ce), ("pitched", pitched))
        host = (("kernel", 1e-5), ("copy_engine", 1e-5), ("pitched", host_pitched))
        return Entry(Shape(True, True, 4096.0, 1 << 20), seconds, host)

    every = (*ALL, "pitched")
    assert e(1.0, 9.0, 1.05).best(every) == "pitched"
    assert e(1.0, 1.08, 1.05).best(every) == "pitched"  # the faster of the two
    assert e(1.0, 1.02, 1.05).best(every) == "copy_engine"
    assert e(1.0, 9.0, 1.2).best(every) == "kernel"  # beyond COPY_ENGINE_SLACK
    assert e(1.0, 9.0, 1.2).best(every, deferred=True) == "pitched"  # within the wide slack
    assert e(1.0, 9.0, 1.6).best(every, deferred=True) == "kernel"
    assert e(1.0, 9.0, 1.05).best(ALL) == "kernel"  # not allowed: one layer, uneven layers
    slow_host = e(1.0, 9.0, 0.9, host_pitched=1e-3)
    assert slow_host.best(every) == "kernel" and slow_host.best(every, deferred=True) == "pitched"


def _with_split(kernel, pitched, split_s, share=math.nan, run=4096.0, total=1 << 20):
    seconds = (("kernel", kernel), ("pitched", pitched), ("split", split_s))
    host = (("kernel", 1e-5), ("pitched", 1e-3), ("split", 1e-3))  # both hold the host
    return Entry(Shape(True, True, run, total), seconds, host, share)


def test_deferred_transfers_take_the_split_where_no_dma_backend_is_within_the_slack():
    """The split (the kernel on 2 blocks beside the pitched copy) is offered to the issuer only;
    it is taken where no DMA backend is within the deferred slack and it is, and never on the
    caller's thread, where its host time bars it."""
    every = ("kernel", "pitched", "split")
    wide = copy_table.DEFERRED_COPY_ENGINE_SLACK
    assert _with_split(1.0, 2.5, 1.2).best(every, deferred=True) == "split"
    assert _with_split(1.0, 2.5, 1.2).best(every) == "kernel"  # its host time: not here
    assert _with_split(1.0, 1.4, 1.2).best(every, deferred=True) == "pitched"  # DMA first
    assert _with_split(1.0, 2.5, 1 + wide * 1.01).best(every, deferred=True) == "kernel"
    assert _with_split(1.0, 2.5, 0.9).best(every, deferred=True) == "split"  # the fastest
    assert _with_split(1.0, 2.5, 1.2).best(("kernel", "pitched"), deferred=True) == "kernel"
    assert _with_split(1.0, 2.5, INF).best(every, deferred=True) == "kernel"  # not measured


def test_the_split_share_is_the_measured_one_around_a_shape():
    from pagekv.kernels import split

    table = CopyTable("k", "GPU", (
        _with_split(1.0, 2.5, 1.2, share=0.3, run=4096.0),
        _with_split(1.0, 2.5, 1.2, share=0.5, run=8192.0),
        _with_split(1.0, 2.5, 1.2, run=16384.0),  # no share measured
    ))  # fmt: skip
    at = lambda run: table.split_share(Shape(True, True, run, 1 << 20))  # noqa: E731
    assert at(4096.0) == 0.3 and at(8192.0) == 0.5
    assert at(6000.0) == pytest.approx(0.4)  # between: the mean of both sides
    assert at(12000.0) == 0.5  # the side without a share is left out
    assert at(16384.0) == split.FALLBACK_SHARE == at(1000.0)  # none measured; below the grid
    assert table.split_share(Shape(False, True, 4096.0, 1 << 20)) == split.FALLBACK_SHARE
    # both halves end together: the pitched copy's share is the kernel's part of the time
    assert split.balanced_share(2.0, 3.0) == pytest.approx(0.4)
    assert math.isnan(split.balanced_share(INF, 3.0)) and math.isnan(split.balanced_share(0, 1))
    assert [split.pitched_count(10, x) for x in (0.0, 0.37, 1.0)] == [0, 4, 10]
    with pytest.raises(ValueError, match="share"):
        split.pitched_count(10, 1.01)


def test_a_shapes_split_share_is_worked_out_once(monkeypatch):
    table = CopyTable("k", "GPU", (_with_split(1.0, 2.5, 1.2, share=0.3, run=4096.0),))
    scans = []
    real = CopyTable._neighbours
    monkeypatch.setattr(
        CopyTable, "_neighbours", lambda t, shape: scans.append(shape) or real(t, shape)
    )
    shape = Shape(True, True, 4096.0, 1 << 20)
    assert [table.split_share(shape) for _ in range(3)] == [0.3] * 3 and len(scans) == 1
    assert table.choose(shape, ("kernel",)) == "kernel" and len(scans) == 2  # its own entry


def test_a_split_share_outside_zero_to_one_is_refused_before_anything_moves():
    kv = DeviceKV.from_caches(GEO, *(torch.zeros(4, 32, 2, 64, dtype=torch.bfloat16),) * 2)
    pool = HostPagePool(GEO, 2, pin=False)
    pool.buffer.fill_(1)
    for bad in (-0.5, 2.0, math.nan):
        with pytest.raises(ValueError, match="share"):
            load(pool.buffer, [0], kv, torch.arange(16), backend="split", dma_share=bad)
    assert not any(t.any() for g in kv.layers for t in g)


def test_layer_pitches_name_the_layouts_a_pitched_copy_suits(monkeypatch):
    geo = KVGeometry(4, 16, 2, 64, "bf16")  # 256-byte rows
    row, slots = geo.item_bytes, 40
    per_kv = [torch.empty(4, slots, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    assert DeviceKV.from_caches(geo, *per_kv).layer_pitches == (slots * row,) * 2
    both = torch.empty(4, 2, slots, 2, 64, dtype=torch.bfloat16)  # [layer, K/V, slot]
    assert DeviceKV.from_caches(geo, both[:, 0], both[:, 1]).layer_pitches == (2 * slots * row,) * 2
    strided = torch.empty(4, slots, 2, 2, 64, dtype=torch.bfloat16)  # K and V of a slot together
    kv = DeviceKV.from_caches(geo, strided[:, :, 0], strided[:, :, 1])
    assert kv.layer_pitches == (2 * slots * row,) * 2
    flat = torch.empty(4 * slots * 2 * 64 + 999, dtype=torch.bfloat16)
    uneven = [flat[o : o + slots * 128].view(slots, 2, 64) for o in (0, 5000, 10240, 15360)]
    assert DeviceKV.from_caches(geo, uneven, per_kv[1]).layer_pitches is None
    backwards = list(per_kv[0].unbind(0))[::-1]  # layer 0 last: the rows would go backwards
    assert DeviceKV.from_caches(geo, backwards, per_kv[1]).layer_pitches is None
    overlapping = [flat[o : o + slots * 128].view(slots, 2, 64) for o in (0, 100, 200, 300)]
    assert DeviceKV.from_caches(geo, overlapping, per_kv[1]).layer_pitches is None
    monkeypatch.setattr(layout, "MAX_PITCH", slots * row - 1)  # farther apart than a pitch may be
    assert DeviceKV.from_caches(geo, *per_kv).layer_pitches is None
    one = KVGeometry.mla(1, 16, 576, torch.bfloat16)  # one layer: no pitch between layers
    latent = torch.empty(1, slots, 576, dtype=torch.bfloat16)
    assert DeviceKV.from_caches(one, latent).layer_pitches == (slots * 1152,)


def test_choices_are_remembered_and_bounded(monkeypatch):
    table = CopyTable("k", "GPU", TABLE.entries)
    calls = []
    agreed = CopyTable._agreed
    monkeypatch.setattr(CopyTable, "_agreed", lambda self, *a: calls.append(a) or agreed(self, *a))
    assert [pick(run=32768, table=table) for _ in range(3)] == ["copy_engine"] * 3
    assert len(calls) == 1
    assert pick(run=32768, allowed=("kernel",), table=table) == "kernel"  # another key
    assert len(calls) == 2
    monkeypatch.setattr(copy_table, "MEMO_MAX", 4)
    for run in range(10):
        pick(run=32768 + run, table=table)
    assert len(table._memo) <= 4
    assert table == CopyTable("k", "GPU", TABLE.entries)  # the memo is not part of equality


def test_calibration_geometries_have_the_grid_runs():
    from pagekv.kernels._calibrate import _geometry

    for run in copy_table.RUN_BYTES:
        for all_layers in (True, False):
            geo = _geometry(all_layers, run)
            assert geo.page_size * geo.item_bytes == run
    assert _geometry(True, 36864).is_mla and _geometry(True, 36864).page_size == 32


def test_table_cache_round_trip_key_and_bad_files(tmp_path, caplog):
    path = copy_table.table_path(tmp_path, "k")
    copy_table.save_table(path, TABLE)
    assert copy_table.load_table(path, "k") == TABLE
    shared = CopyTable("k", "GPU", (_with_split(1.0, 2.5, 1.2, share=0.35),))
    copy_table.save_table(path, shared)
    assert copy_table.load_table(path, "k").entries[0].split_share == 0.35
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


def never(*_):
    raise AssertionError("not to be called here")


def test_measured_once_then_read_from_the_cache(tmp_path):
    path = copy_table.table_path(tmp_path / "cache", "k")
    calls = []

    def measure():
        calls.append(1)
        return TABLE, None

    assert copy_table.cached_or_measured(path, "k", measure, never) == (TABLE, True)
    assert copy_table.cached_or_measured(path, "k", measure, never) == (TABLE, False)
    assert len(calls) == 1
    key_b = "other"
    table_b = CopyTable(key_b, "GPU", TABLE.entries[:1])
    path_b = copy_table.table_path(tmp_path / "cache", key_b)
    got = copy_table.cached_or_measured(path_b, key_b, lambda: (table_b, None), never)
    assert got == (table_b, True)
    assert copy_table.load_table(path, "k") == TABLE  # one file per key


def busy_table(wait):
    return CopyTable("k", "GPU", TABLE.entries[:2], host_wait=wait)


def test_a_table_measured_after_a_refused_call_is_not_cached(tmp_path, caplog):
    """Measured where a backend's calls were refused (so not timed), the table serves the
    measuring process and is not cached, after one warning: cached, it would hold every later
    process to it. The next process measures again and caches a good one."""
    path = copy_table.table_path(tmp_path / "cache", "k")
    unfit = "without batched copies (refused)"
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        got = copy_table.measured_or_empty(path, "k", "GPU", lambda: (TABLE, unfit), never)
    assert got == (TABLE, True) and not path.exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"pagekv: the copy table measured {unfit} is not cached; the next process measures again"
    ]
    assert copy_table.cached_or_measured(path, "k", lambda: (TABLE, None), never) == (TABLE, True)
    assert copy_table.cached_or_measured(path, "k", never, never) == (TABLE, False)


def test_a_table_measured_on_a_busy_host_is_provisional_until_a_quiet_start_up(tmp_path,
                                                                             caplog):  # fmt: skip
    """A table measured on a busy host is cached as provisional (one warning): later processes
    use it without measuring while a trial finds the host busy too; one whose trial finds it
    quiet measures again, and caches its table if it is the device's or less busy than the
    cached one, else uses the cached one. The device's table is then read with no trial."""
    path = copy_table.table_path(tmp_path / "cache", "k")
    measured, trials = [], []

    def measure(table):
        def run():
            measured.append(table.host_wait)
            return table, None

        return run

    def trial(verdict):
        def run():
            trials.append(verdict)
            return verdict

        return run

    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        got = copy_table.cached_or_measured(path, "k", measure(busy_table(0.4)), never)
    assert got == (busy_table(0.4), True) and copy_table.load_table(path, "k") == busy_table(0.4)
    assert ["cached as provisional" in r.getMessage() for r in caplog.records] == [True]
    assert "0.40" in caplog.records[0].getMessage()
    # busy now too: the provisional table, nothing measured
    got = copy_table.cached_or_measured(path, "k", never, trial("on a busy host (now)"))
    assert got == (busy_table(0.4), False)
    # quiet by the trial, busier by the measurement: the cached one is kept and used, and
    # written anew (processes that waited for the lock meanwhile take it without a trial)
    caplog.clear()
    written = copy_table._written(path)
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        got = copy_table.cached_or_measured(path, "k", measure(busy_table(0.6)), trial(None))
    assert copy_table._written(path) != written
    assert got == (busy_table(0.4), True) and copy_table.load_table(path, "k") == busy_table(0.4)
    assert ["less busy host (0.40)" in r.getMessage() for r in caplog.records] == [True]
    # less busy: replaces it
    got = copy_table.cached_or_measured(path, "k", measure(busy_table(0.1)), trial(None))
    assert got == (busy_table(0.1), True) and copy_table.load_table(path, "k") == busy_table(0.1)
    # the device's: replaces it, and is then read with no trial
    got = copy_table.cached_or_measured(path, "k", measure(TABLE), trial(None))
    assert got == (TABLE, True) and copy_table.load_table(path, "k") == TABLE
    assert copy_table.cached_or_measured(path, "k", never, never) == (TABLE, False)
    assert measured == [0.4, 0.6, 0.1, None] and trials == ["on a busy host (now)", None, None,
                                                           None]  # fmt: skip


def test_a_provisional_table_survives_a_refused_measurement(tmp_path):
    path = copy_table.table_path(tmp_path / "cache", "k")
    copy_table.save_table(path, busy_table(0.3))
    got = copy_table.cached_or_measured(path, "k", lambda: (TABLE, "without pitched copies"),
                                        lambda: None)  # fmt: skip
    assert got == (TABLE, True) and copy_table.load_table(path, "k") == busy_table(0.3)


def test_a_trial_that_fails_leaves_the_provisional_table_in_use(tmp_path, caplog):
    path = copy_table.table_path(tmp_path / "cache", "k")
    copy_table.save_table(path, busy_table(0.3))

    def trial():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with caplog.at_level(logging.INFO, logger="pagekv.kernels.copy_table"):
        got = copy_table.measured_or_empty(path, "k", "GPU", never, trial)
    assert got == (busy_table(0.3), False)
    assert "the trial failed (CUDA out of memory)" in caplog.text


_CONCURRENT_CHILD = """
import sys
from pathlib import Path
from pagekv.kernels import copy_table
path, marks = Path(sys.argv[1]), Path(sys.argv[2])
busy = copy_table.CopyTable("k", "GPU", (), host_wait=0.5)

def measure():
    (marks / f"measured-{sys.argv[3]}").touch()
    return busy, None

def trial():
    (marks / f"trial-{sys.argv[3]}").touch()
    return "on a busy host (still)"

table, fresh = copy_table.cached_or_measured(path, "k", measure, trial)
assert table == busy, table
"""


def _blocked_on(lock_path) -> int:
    """Processes waiting for a flock on ``lock_path`` (Linux ``/proc/locks``: ``->`` marks a
    waiter; the fifth field is major:minor:inode)."""
    inode = os.stat(lock_path).st_ino
    with open("/proc/locks") as f:
        rows = [line.split() for line in f]
    return sum(1 for r in rows if r[1] == "->" and r[2] == "FLOCK"
               and int(r[6].split(":")[-1]) == inode)  # fmt: skip


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks")
def test_processes_starting_together_on_a_busy_host_measure_once(tmp_path):
    """Processes calibrating at once on a busy host (an engine's tensor-parallel workers at
    start-up): one measures, and each other one, having waited for the lock meanwhile, uses
    its provisional table as it is (no trial, no measurement), instead of each measuring in
    turn. A process starting after them runs the trial, and with the host still busy uses it
    too. Restarted together on the busy host, one runs the trial and the others take its
    verdict (no trial each in turn)."""
    path = copy_table.table_path(tmp_path / "cache", "k")
    marks = tmp_path / "marks"
    marks.mkdir()
    path.parent.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def start(i):
        return subprocess.Popen([sys.executable, "-c", _CONCURRENT_CHILD, str(path), str(marks),
                                 str(i)], cwd=root)  # fmt: skip

    def together(ids):  # each has looked at the cache and waits for the lock, then all run
        lock_path = path.with_suffix(".lock")
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            procs = [start(i) for i in ids]
            deadline = time.monotonic() + 120
            while _blocked_on(lock_path) < len(ids):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
                time.sleep(0.01)
        assert [p.wait(timeout=120) for p in procs] == [0] * len(ids)
        return sorted(m.name for m in marks.iterdir())

    first = together(range(4))
    assert len(first) == 1 and first[0].startswith("measured-"), first
    assert start(4).wait(timeout=120) == 0
    assert sorted(m.name for m in marks.iterdir()) == sorted([first[0], "trial-4"])
    # a restart beside a busy host: the provisional table there before they look
    for m in marks.iterdir():
        m.unlink()
    again = together(range(5, 9))
    assert len(again) == 1 and again[0].startswith("trial-"), again


def test_failed_reason_names_what_was_refused_in_this_process(monkeypatch):
    monkeypatch.setattr(copy_engine, "_failed", {})
    monkeypatch.setattr(copy_engine, "_pitched_failed", {})
    assert copy_engine.failed_reason(0) is None
    copy_engine.fail(1, "refused")
    assert copy_engine.failed_reason(0) is None
    assert copy_engine.failed_reason(1) == "batched copies (refused)"
    copy_engine._say_once(copy_engine._pitched_failed, 1, "2-D refused")
    both = "batched copies (refused) and pitched copies (2-D refused)"
    assert copy_engine.failed_reason(1) == both


def test_host_load_from_the_measuring_threads_wait_for_a_cpu():
    quiet = _calibrate.host_load((1.0, 0.0), (3.0, 0.09))
    assert quiet == _calibrate.HostLoad(2.0, 0.09) and not quiet.busy  # under 5% of 2 s
    busy = _calibrate.host_load((1.0, 0.0), (3.0, 0.2))
    assert busy.busy and busy.share == pytest.approx(0.1)
    assert busy.reason() == (
        "on a busy host (the measuring thread waited 0.2 s for a CPU while running 2.0 s)"
    )
    assert not _calibrate.host_load((1.0, 0.0), (1.0, 0.4)).busy  # nothing ran: nothing timed
    assert _calibrate.host_load(None, None) == _calibrate.HostLoad(0.0, 0.0)  # no schedstat
    assert _calibrate.host_load((1.0, 0.0), None) == _calibrate.HostLoad(0.0, 0.0)
    assert _calibrate.HostLoad(0.0, 0.0).share == 0


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                    reason="needs Linux's schedstat (CONFIG_SCHED_INFO)")  # fmt: skip
def test_a_thread_beside_more_spinning_processes_than_cpus_measures_a_busy_host():
    """thread_seconds counts the calling thread's wait for a CPU: beside twice as many
    processes spinning as it may use, a thread spinning 0.3 s waits about as long as it runs."""
    cpus = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 * cpus)]  # fmt: skip
    try:
        before = _calibrate.thread_seconds()
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        after = _calibrate.thread_seconds()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert after[0] > before[0]
    assert _calibrate.host_load(before, after).busy, (before, after)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                    reason="needs Linux's schedstat (CONFIG_SCHED_INFO)")  # fmt: skip
def test_thread_seconds_are_the_calling_threads_own():
    """Another thread's run (here 0.3 s of pure Python holding the GIL in turns) is not in the
    calling thread's count, which sleeps meanwhile."""
    before = _calibrate.thread_seconds()
    done = threading.Event()

    def spin():
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        done.set()

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    after = _calibrate.thread_seconds()
    assert done.is_set() and after[0] - before[0] < 0.1, (before, after)


def test_a_failed_measurement_leaves_auto_on_the_kernel_and_nothing_cached(tmp_path, caplog):
    path = copy_table.table_path(tmp_path / "cache", "k")

    def measure():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_table"):
        table, fresh = copy_table.measured_or_empty(path, "k", "GPU", measure, never)
    assert not fresh and table.entries == ()
    assert table.choose(Shape(True, True, 32768, 16 << 20), ALL) == "kernel"
    assert not path.exists()
    assert ["out of memory" in r.getMessage() for r in caplog.records] == [True]
    got = copy_table.measured_or_empty(path, "k", "GPU", lambda: (TABLE, None), never)
    assert got == (TABLE, True)


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


def test_run_bytes():
    """The mean bytes of a copy-engine copy: one per run of consecutive valid slots of a page
    (the library's count where it is loaded, else layout.slot_runs)."""
    both = torch.empty(2, GEO.num_layers, 100, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, both[0], both[1])
    slots = torch.arange(32).view(2, 16)
    assert copy_engine.run_bytes(kv, slots) == 16 * GEO.item_bytes
    slots[0, 8] = -1  # splits page 0's run: 3 runs of 31 tokens
    assert copy_engine.run_bytes(kv, slots) == 31 * GEO.item_bytes / 3
    slots[1] = torch.arange(65, 49, -1)  # descending: 16 runs of one token
    assert copy_engine.run_bytes(kv, slots) == 31 * GEO.item_bytes / 18
    strided = torch.empty(GEO.num_layers, 100, 2, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, strided[:, :, 0], strided[:, :, 1])
    assert copy_engine.run_bytes(kv, torch.arange(32).view(2, 16)) == GEO.item_bytes  # 1-token runs


# ---- fallback when the driver refuses a call -------------------------------------------------
class RefusingLib:
    """Stands in for the library: every copy-engine call, batched or pitched, is refused with
    cudaErrorInvalidValue (``AcceptingLib``: succeeds); ``calls`` keeps their arguments."""

    result = 1

    def __init__(self):
        self.calls = []

    def _answer(self, *args):
        self.calls.append(args)
        return self.result

    pagekv_ce_page_transfer = pagekv_pitched_page_transfer = _answer
    pagekv_ce_page_transfer_layers = _answer


class AcceptingLib(RefusingLib):
    result = 0


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
    assert args[15:23] == (0, 4, copy_engine.FLAGS, copy_engine.LANES, copy_engine.LAYER_LANES,
                           copy_engine.ENQUEUE_THREADS, copy_engine.ENQUEUE_THREAD_COPIES,
                           copy_engine.MAX_OPS)  # fmt: skip


def test_every_call_gives_the_library_both_lane_counts_and_its_threads(monkeypatch):
    """The library picks LANES for an all-layer transfer and LAYER_LANES for fewer layers,
    and sends a call from up to ENQUEUE_THREADS threads, one per ENQUEUE_THREAD_COPIES copies
    (checked on the GPU by the streams and threads it reports using); both entries get every
    setting."""
    monkeypatch.setattr(copy_engine, "LANES", 16)
    monkeypatch.setattr(copy_engine, "LAYER_LANES", 1)
    monkeypatch.setattr(copy_engine, "ENQUEUE_THREADS", 3)
    monkeypatch.setattr(copy_engine, "ENQUEUE_THREAD_COPIES", 77)
    both = torch.empty(2, GEO.num_layers, 100, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, both[0], both[1])
    pool = HostPagePool(GEO, 4, pin=False)
    ids, slots = torch.tensor([1, 3]), torch.arange(32).view(2, 16)
    lib = AcceptingLib()
    assert copy_engine.page_transfer(lib, True, pool.buffer, kv, ids, slots, 0, GEO.num_layers, 0)
    assert copy_engine.page_transfer(lib, False, pool.buffer, kv, ids, slots, 2, 1, 0)
    every, one = lib.calls
    assert every[15:22] == (0, GEO.num_layers, copy_engine.FLAGS, 16, 1, 3, 77)
    assert one[15:22] == (2, 1, copy_engine.FLAGS, 16, 1, 3, 77)
    lib.calls.clear()
    events = [type("Event", (), {"cuda_event": 0})() for _ in range(3)]
    copy_engine.page_transfer_layers(lib, True, pool.buffer, kv, ids, slots, [None, 0, 1],
                                     events, 0)  # fmt: skip
    (args,) = lib.calls
    assert list(args[15][:3]) == [-1, 0, 1] and args[16] == 3
    assert args[18:23] == (copy_engine.FLAGS, 16, 1, 3, 77)  # lanes, layer lanes, threads


def test_a_failed_pitched_copy_is_logged_once_and_leaves_the_batched_copies(monkeypatch, caplog):
    monkeypatch.setattr(copy_engine, "_failed", {})
    monkeypatch.setattr(copy_engine, "_pitched_failed", {})
    monkeypatch.setattr(copy_engine, "_support", lambda device: 13000)
    both = torch.empty(2, GEO.num_layers, 100, 2, 64, dtype=torch.bfloat16)
    kv = DeviceKV.from_caches(GEO, both[0], both[1])
    pool = HostPagePool(GEO, 4, pin=False)
    ids, slots = torch.tensor([1, 3]), torch.arange(32).view(2, 16)
    lib = RefusingLib()
    with caplog.at_level(logging.WARNING, logger="pagekv.kernels.copy_engine"):
        for _ in range(3):
            assert not copy_engine.pitched_transfer(lib, False, pool.buffer, kv, ids, slots, 0)
    lines = [r.getMessage() for r in caplog.records if "copy-engine" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("pagekv: pitched copy-engine save failed")
    assert "cudaError 1" in lines[0] and "use the kernel" in lines[0]
    assert not copy_engine.pitched_supported(0) and copy_engine.pitched_supported(1)
    assert copy_engine.supported(0)  # the batched copies are another form: still used
    pitches = lib.calls[0][4]  # after device, direction, host and the layers' pointers
    assert list(pitches) == list(kv.layer_pitches) == [100 * GEO.item_bytes] * 2


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
    with pytest.raises(ValueError, match="needs CUDA"):
        save(kv, torch.arange(16), pool.buffer, [0], backend="pitched")
    with pytest.raises(ValueError, match="needs CUDA"):
        save(kv, torch.arange(16), pool.buffer, [0], backend="split")
    for setting in ("copy_engine", "kernel", "direct", "pitched", "split"):
        monkeypatch.setenv("PAGEKV_COPY_BACKEND", setting)
        assert load(pool.buffer, [0], kv, torch.arange(16)) == "torch"  # no GPU: the reference


@pytest.mark.parametrize("n", [1, 3, 63, 64, 65, 127, 128, 129, 1000, 1024])
@pytest.mark.parametrize("min_per", [1, 4, 64])
def test_staged_chunks_cover_every_page_once_and_taper_where_no_dma_hides_the_kernel(n, min_per):
    per = 64
    for is_load in (True, False):
        bounds = staged.chunks(n, per, min_per, is_load)
        sizes = [end - first for first, end in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == n, bounds
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), bounds
        assert all(0 < size <= per for size in sizes), sizes
        tail = sizes if is_load else sizes[::-1]  # the load's end, the save's start
        if min_per >= per:  # no taper: full chunks, then the rest
            assert tail == [per] * (n // per) + [n % per] * (n % per > 0), sizes
        else:
            assert tail[-1] <= min_per, sizes  # the unhidden kernel step is at most min_per
            big = [s for s in tail if s > min_per]
            assert big == sorted(big, reverse=True), sizes  # never growing towards that end
            assert len(bounds) <= n // per + 2 + math.ceil(math.log2(per)), sizes


def test_auto_offers_the_table_the_copy_engine_from_its_floor_and_the_split_to_the_issuer():
    def offered(run, all_layers=True, deferred=False, ce=True, pitched=True):
        return ops.table_candidates(run, all_layers, deferred, ce, pitched)

    caller, issuer = ops.COPY_ENGINE_MIN_RUN, ops.DEFERRED_COPY_ENGINE_MIN_RUN
    assert offered(caller) == ["kernel", "direct", "copy_engine", "pitched"]
    assert offered(caller - 1) == ["kernel", "direct", "pitched"]
    assert offered(issuer, deferred=True) == ["kernel", "direct", "copy_engine", "pitched", "split"]
    assert offered(issuer - 1, deferred=True) == ["kernel", "direct", "pitched", "split"]
    assert offered(caller, ce=False) == ["kernel", "direct", "pitched"]
    assert offered(caller, all_layers=False, deferred=True) == ["kernel", "direct", "copy_engine"]
    assert offered(caller, pitched=False, deferred=True) == ["kernel", "direct", "copy_engine"]
