"""The kernels' build route, checked where CI runs (nvcc, no GPU): every .cu compiles, the
library loads and its entry points reject bad launches; the cache lock builds once."""

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from pagekv.connector.copy_issuer import Completion
from pagekv.errors import CopyFailed
from pagekv.geometry import KVGeometry
from pagekv.kernels import DeviceKV, copy_engine, jit
from pagekv.kernels.layout import slot_runs

NVCC = jit.find_nvcc()
needs_nvcc = pytest.mark.skipif(
    NVCC is None and not os.environ.get("CI"),
    reason="nvcc not installed (CI has it and runs this check)",
)


def test_every_cu_source_is_built():
    on_disk = sorted(p.name for p in jit.CSRC.glob("*.cu"))
    assert on_disk and on_disk == sorted(p.name for p in jit.SOURCES)


@needs_nvcc
def test_sources_compile_and_library_loads(tmp_path):
    if NVCC is None:
        pytest.fail("CI must have nvcc: the compile check cannot be skipped there")
    lib_path = jit.build_library("90", directory=tmp_path)
    assert lib_path.exists() and lib_path.stat().st_size > 10_000
    assert jit.build_library("90", directory=tmp_path) == lib_path  # cached
    lib = jit._open(lib_path)
    assert lib.pagekv_abi_version() == jit._ABI_VERSION == 10
    # Bad launch parameters are refused before any CUDA call (cudaErrorInvalidValue == 1).
    plan = jit.PagePlan(device=0, layer_ptrs=0, num_slots=1, page_bytes=1 << 14, slot_stride=256,
                        item_bytes=256, page_size=16, num_kv=2, num_layers=4)  # fmt: skip
    good = dict(layer=0, width=16, blocks=8, threads=1024, unroll8=0)
    bad = [dict(width=3), dict(blocks=0), dict(threads=1056), dict(unroll8=1),  # 8 needs <= 512
           dict(layer=4), dict(layer=-2)]  # fmt: skip

    def page_transfer(n_pages: int, **change) -> int:
        a = {**good, **change}
        return lib.pagekv_page_plan_transfer(
            ctypes.addressof(plan), jit.PAGE_LOAD | (jit.PAGE_UNROLL8 * a["unroll8"]), None, 1,
            None, None, n_pages, a["layer"], a["width"], a["blocks"], a["threads"], None,
        )  # fmt: skip

    assert page_transfer(0) == 0  # good parameters, no pages: nothing to launch
    for change in bad:
        assert page_transfer(0, **change) == 1, change
    # the plan's fields land where the library reads them: the last layer is accepted, and a
    # row no longer a multiple of the access width is refused
    assert page_transfer(0, layer=plan.num_layers - 1) == 0
    plan.item_bytes = 264
    assert page_transfer(0, width=8) == 0 and page_transfer(0, width=16) == 1
    err = lib.pagekv_store_kv(0, None, None, None, None, None, 0, 1, 1, 0, 0, 0, 0,
                              256, 16, 1, 2000, None)  # fmt: skip
    assert err == 1  # 2000 threads
    err = lib.pagekv_slot_copy(0, None, None, None, 0, None, 0, 1, 1, 1, 1, 1,
                               256, 2, 4, 3, 2, 16, 8, 1024, None)  # fmt: skip
    assert err == 1  # layers 3..4 of 4
    # copy engine: bad arguments are refused before any CUDA call
    ce = lib.pagekv_ce_page_transfer
    good = [0, 1, None, None, None, None, 1, 1, 1, 1, 256, 256, 16, 2, 4, 0, 4, 1, 2, 2, 2, 512,
            16384, None, None]  # fmt: skip
    # K/V groups, layers, first layer, page size, lanes and layer lanes (two each), threads
    # (two), copies a thread, descriptors per call
    bad = ((13, 3), (16, 5), (15, -1), (12, 0), (18, 0), (18, 17), (19, 0), (19, 17), (20, 0),
           (20, 5), (21, 0), (22, 0))  # fmt: skip
    for index, value in bad:
        args = list(good)
        args[index] = value
        assert ce(*args) == 1, (index, value)
    if not torch.cuda.is_available():
        assert lib.pagekv_copy_engine_support(0) == 0
    check_slot_runs(lib)
    check_progress(lib, jit._open(lib_path, ctypes.PyDLL))


def check_slot_runs(lib):
    """The library's run count (no GPU needed) is layout.slot_runs's (the torch count), on
    random tables with skipped slots, descending and page-crossing runs."""
    geo = KVGeometry(2, 16, 1, 128, "bf16")
    kv = DeviceKV.from_caches(geo, torch.empty(2, 4096, 1, 128, dtype=torch.bfloat16),
                              torch.empty(2, 4096, 1, 128, dtype=torch.bfloat16))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    tables = [torch.arange(64).view(4, 16), torch.arange(63, -1, -1).view(4, 16),
              torch.full((3, 16), -1), torch.empty(0, 16, dtype=torch.int64)]  # fmt: skip
    for skip in (0.0, 0.05, 0.5):
        s = (torch.randperm(256, generator=gen)[:, None] * 16 + torch.arange(16)).contiguous()
        s[torch.rand(s.shape, generator=gen) < skip] = -1
        tables.append(s)
    out = (ctypes.c_int64 * 2)()
    for s in tables:
        assert lib.pagekv_slot_runs(s.data_ptr(), s.shape[0], 16, out) == 0
        assert (out[0], out[1]) == slot_runs(kv, s), s
        assert out[0] == int((s >= 0).sum())
    assert lib.pagekv_slot_runs(None, 1, 16, out) == 1


def check_progress(lib, lib_gil):
    """A layer-by-layer transfer's progress count (no GPU needed): a waiter sleeps in the
    library, the GIL given up, until the entry it waits for is counted, or the count ends; the
    count never goes back. A completion on it is handed over by the count or by the issuer
    (its event set first), and one the issuer failed raises."""
    progress = copy_engine.Progress(lib, lib_gil, torch.device("cuda", 0), 3, fork=None)
    assert progress.count() == 0 and not progress.counted(0)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(progress.wait(1)))
    waiter.start()
    progress.publish(1)  # this thread runs Python while the waiter sleeps: it holds no GIL
    waiter.join(0.2)
    assert waiter.is_alive() and progress.counted(0) and not progress.counted(1)
    progress.publish(2)
    waiter.join(10)
    assert got == [True] and progress.count() == 2
    progress.publish(1)
    assert progress.count() == 2  # never back
    counted, handed, failed = (Completion(progress, i) for i in range(3))
    assert counted.enqueued and counted._wait_enqueued() is progress.events[0]
    event = object()  # what the issuer hands over (the kernel's event after a refusal)
    handed._set(event)
    assert handed._wait_enqueued() is event
    raised: list[BaseException] = []

    def wait_failed():
        try:
            failed._wait_enqueued()
        except CopyFailed as e:
            raised.append(e)

    waiter = threading.Thread(target=wait_failed)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not failed.enqueued
    failed._set(None, RuntimeError("a stand-in"))  # as the issuer fails a job: set, then end
    progress.end()
    waiter.join(10)
    assert len(raised) == 1 and "stand-in" in str(raised[0])
    assert not progress.wait(2) and progress.count() == 2


@needs_nvcc
def test_layer_by_layer_copies_spread_over_threads_keep_the_events_order(tmp_path):
    """The copy-engine library's layer-by-layer call with its one-layer entries spread over two
    host threads, built with the host compiler against a recording CUDA runtime
    (tests/native/copy_engine_spread.cpp): each entry on its worker's stream, events recorded in
    entry order after a wait on the one before, the side stream forked and joined back, the
    progress count; a layer's copies refused at any entry: the error returned within a
    deadline, only the entries before it counted, the side stream still joined."""
    if NVCC is None:
        pytest.fail("CI must have nvcc: the check cannot be skipped there")
    include = Path(NVCC).resolve().parent.parent / "include"
    harness = Path(__file__).parent / "native" / "copy_engine_spread.cpp"
    exe = tmp_path / "spread"
    cxx = os.environ.get("CXX", "g++")
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-pthread", "-x", "c++", f"-I{include}",
         str(jit.CSRC / "copy_engine.cu"), "-x", "none", str(harness), "-o", str(exe)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "all checks passed" in ran.stdout, ran.stdout + ran.stderr


def test_compile_failure_is_reported(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cu"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(jit, "SOURCES", (bad,))
    fake = _fake_nvcc(tmp_path, fail=True)
    with pytest.raises(jit.KernelsUnavailable, match="nvcc failed for sm_90"):
        jit.build_library("90", nvcc=str(fake), directory=tmp_path / "cache")


def test_missing_nvcc_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "find_nvcc", lambda: None)
    with pytest.raises(jit.KernelsUnavailable, match="nvcc not found"):
        jit.build_library("90", directory=tmp_path)


def _fake_nvcc(tmp_path: Path, fail: bool = False) -> Path:
    """An nvcc stand-in: logs each build, sleeps (so builds overlap), writes the -o file."""
    script = tmp_path / "nvcc"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        if "--version" in sys.argv:
            print("Cuda compilation tools, release 99.9, V99.9"); sys.exit(0)
        if {fail}:
            print("error: bad source", file=sys.stderr); sys.exit(1)
        open({str(tmp_path / "builds.log")!r}, "a").write("build\\n")
        time.sleep(0.5)
        open(sys.argv[sys.argv.index("-o") + 1], "wb").write(b"lib")
        """)
    )
    script.chmod(0o755)
    return script


def test_concurrent_builds_build_once(tmp_path):
    fake = _fake_nvcc(tmp_path)
    cache = tmp_path / "cache"
    code = (
        "import sys; from pathlib import Path; from pagekv.kernels import jit; "
        f"print(jit.build_library('90', nvcc={str(fake)!r}, directory=Path({str(cache)!r})))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)]
    procs += [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)]
    results = []
    thread = threading.Thread(
        target=lambda: results.append(jit.build_library("90", nvcc=str(fake), directory=cache))
    )
    thread.start()
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    thread.join()
    assert all(p.returncode == 0 for p in procs)
    assert len({*outs, str(results[0])}) == 1
    assert (tmp_path / "builds.log").read_text().count("build") == 1
    assert "cu99.9" in outs[0]


def test_torch_mode_env(monkeypatch):
    monkeypatch.setenv("PAGEKV_KERNELS", "torch")
    jit._load.cache_clear()
    try:
        assert "PAGEKV_KERNELS=torch" in jit.kernels_unavailable_reason()
        assert jit.load_library() is None
    finally:
        jit._load.cache_clear()


def test_cuda_mode_without_gpu_raises(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    monkeypatch.setenv("PAGEKV_KERNELS", "cuda")
    jit._load.cache_clear()
    try:
        with pytest.raises(jit.KernelsUnavailable, match="no CUDA device"):
            jit.load_library()
    finally:
        jit._load.cache_clear()


def test_bad_mode_env(monkeypatch):
    monkeypatch.setenv("PAGEKV_KERNELS", "fast")
    with pytest.raises(ValueError, match="PAGEKV_KERNELS"):
        jit.backend_mode()


def test_import_without_gpu_does_not_build_or_crash():
    code = "import pagekv.kernels as k; print(k.kernels_unavailable_reason() or 'ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip()
