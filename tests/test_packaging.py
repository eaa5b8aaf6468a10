"""Packaging: the store and the CLI without torch (a clear error for what needs it), sdist and
wheel contents and metadata, a wheel installed in a fresh venv, `make` printing its targets,
and benchmarks that write outside the tree with no NaN in their JSON."""

import gc
import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import pagekv
from pagekv import env
from pagekv.store.cli.settings import tomllib

ROOT = Path(__file__).resolve().parent.parent
NATIVE_SOURCES = tuple(f"pagekv/store/wire/csrc/{name}" for name in (
    "copy_verify.c", "third_party/xxhash/xxhash.h", "third_party/xxhash/LICENSE"))  # fmt: skip
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_py(code, **kw):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, **kw)  # fmt: skip


def test_store_and_cli_run_without_torch_and_the_rest_says_what_to_install():
    code = NO_TORCH + (
        "import pagekv.store, pagekv.store.cli, pagekv.store.node.metrics\n"
        "import pagekv.store.cli.settings\n"
        "assert sys.modules['torch'] is None\n"
        "for name in ('pagekv.connector', 'pagekv.kernels', 'pagekv.geometry'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError as e:\n"
        "        print(name, e)\n"
        "sys.exit(pagekv.store.cli.main(['--version']))\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == f"pagekv {pagekv.__version__}"
    assert len(lines) == 4 and all("pip install 'pagekv[connector]'" in x for x in lines[:3])


def test_pyproject_license_extras_and_no_torch_in_core():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert not any(dep.startswith(("torch", "numpy")) for dep in meta["dependencies"])
    assert any(dep.startswith("prometheus_client") for dep in meta["dependencies"])
    assert "torch" in meta["optional-dependencies"]["connector"]
    assert "pagekv[connector]" in meta["optional-dependencies"]["test"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """sdist and wheel built from this tree (setuptools from the venv: no download)."""
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                            str(ROOT)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    log = build.stdout + build.stderr
    return out, log


@pytest.mark.slow
def test_sdist_and_wheel_contents_and_no_build_warnings(dist):
    out, log = dist
    for warning in ("is deprecated", "absent from the `packages`", "Package would be ignored"):
        assert warning not in log, log[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("LICENSE", "tests/conftest.py", "tests/helpers.py", "tests/cli_helpers.py",
                   "docs/protocol.md", "scripts/demo.py", "scripts/_bench_util.py",
                   "pagekv/kernels/csrc/pagekv_kernels.cu", *NATIVE_SOURCES):  # fmt: skip
        assert needed in names, needed
    assert not any("__pycache__" in n or n.startswith("benchmarks/results") for n in names)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
        info = next(n for n in files if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(info).decode()
    assert "pagekv/kernels/csrc/pagekv_kernels.cu" in files
    assert set(NATIVE_SOURCES) <= files  # the store's native checked copy builds from these
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in files)
    assert "License-Expression: Apache-2.0" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires and all('extra == "connector"' in line for line in requires)


@pytest.mark.slow
@pytest.mark.skipif(
    env.OFFLINE.get(),
    reason="installs the wheel's dependencies from the package index, and PAGEKV_OFFLINE=1 says "
    "there is none (scripts/gpu_check.sh sets it: the GPU machine has no network)",
)
def test_wheel_installs_and_runs_without_torch(dist, tmp_path):
    out, _ = dist
    (wheel,) = out.glob("*.whl")
    venv.create(tmp_path / "env", with_pip=True)
    py = tmp_path / "env" / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert pip.returncode == 0, pip.stderr[-3000:]
    check = subprocess.run([str(py), "-c", "import importlib.util as u; import pagekv.store; "
                            "print(u.find_spec('torch') is None)"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)  # fmt: skip
    assert check.stdout.strip() == "True", check.stderr
    version = subprocess.run([str(tmp_path / "env" / "bin" / "pagekv"), "--version"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert version.stdout.strip() == f"pagekv {pagekv.__version__}"
    if shutil.which(os.environ.get("CC") or "cc"):  # the native copy builds from the wheel's files
        build = subprocess.run([str(py), "-c", "import sys, pathlib; from pagekv.store.wire "
                                "import native; print(native.build_library(directory=pathlib.Path("
                                "sys.argv[1])))", str(tmp_path / "cache")], capture_output=True,
                               text=True, timeout=300, cwd=tmp_path)  # fmt: skip
        assert build.returncode == 0 and Path(build.stdout.strip()).is_file(), build.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_bare_make_prints_the_targets():
    out = subprocess.run(["make", "-s"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("make TARGET, one of:")
    targets = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert {"help", "test", "lint", "demo", "clean"} <= set(targets)


def test_benchmarks_write_outside_the_tree_without_nan(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delenv("RESULTS_DIR", raising=False)
    import _bench_util

    assert ROOT not in _bench_util.results_dir().parents  # default: a temp dir
    monkeypatch.setattr(_bench_util, "_save", True)
    assert _bench_util.results_dir() == ROOT / "benchmarks" / "results"
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    payload = {"rows": [{"gbps": 1.5, "ratio": float("nan")}], "peak": float("inf"), "n": 3}
    path = _bench_util.write_result("unit", payload, nan_reason="peer not run")
    assert path.parent == tmp_path

    def no_constants(name):
        raise AssertionError(f"{name} in JSON")

    doc = json.loads(path.read_text(), parse_constant=no_constants)
    assert doc["rows"] == [{"gbps": 1.5, "ratio": None}] and doc["peak"] is None and doc["n"] == 3
    assert doc["nulls"] == {"rows[0].ratio": "peer not run", "peak": "peer not run"}


def test_benchmarks_freeze_the_heap_and_record_full_collections(tmp_path, monkeypatch):
    """A benchmark's process is an engine once set up: what is alive is frozen, and each
    result says how many full collections ran meanwhile and how long the longest took."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    import _bench_util

    watch = _bench_util.FULL_COLLECTIONS
    monkeypatch.setattr(watch, "pauses_ms", [])
    try:
        _bench_util.engine_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # pytest's and torch's objects, at least
        gc.collect(1)  # not a full collection: not counted
        assert watch.pauses_ms == []
        gc.collect()
        _bench_util.engine_heap()  # again (a second set-up): its own collection is not counted
        doc = json.loads(_bench_util.write_result("unit", {}).read_text())
    finally:
        watch.uninstall()
        gc.unfreeze()
    assert doc["env"]["gc_frozen"] >= frozen
    assert doc["env"]["gc_full"]["count"] == 1 and doc["env"]["gc_full"]["max_ms"] >= 0
