"""The registry of PAGEKV_* variables: every variable the code reads is registered, each value
goes through its one parser (bad text is a ConfigError naming the variable), and the README's
generated tables are the current ones."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv import env
from pagekv.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_each_variable_parses_its_kind_and_names_itself_on_bad_text():
    assert env.KERNELS.get({}) == "auto"
    assert env.KERNELS.get({"PAGEKV_KERNELS": " Torch "}) == "torch"
    assert env.BULK_CLIENT.get({"PAGEKV_BULK_CLIENT": "0"}) is False
    assert env.BULK_CLIENT.get({"PAGEKV_BULK_CLIENT": "yes"}) is True
    assert env.BULK_CLIENT.get({"PAGEKV_BULK_CLIENT": " "}) is True  # blank: the default
    assert env.MALLOC_TOP_PAD.get({"PAGEKV_MALLOC_TOP_PAD": "8MiB"}) == 8 << 20
    assert env.EXIT_FLUSH_S.get({"PAGEKV_EXIT_FLUSH_S": "2.5"}) == 2.5
    assert env.CACHE_DIR.get({"PAGEKV_CACHE_DIR": "/tmp/x"}) == Path("/tmp/x")
    bad = {"PAGEKV_KERNELS": "gpu", "PAGEKV_BULK_CLIENT": "maybe", "PAGEKV_MALLOC_ARENAS": "two",
           "PAGEKV_MALLOC_TOP_PAD": "lots", "PAGEKV_EXIT_FLUSH_S": "soon"}  # fmt: skip
    for var in env.REGISTRY:
        if var.name in bad:
            with pytest.raises(ConfigError, match=re.escape(f"${var.name}: ")):
                var.get({var.name: bad[var.name]})
    assert {var.name for var in env.REGISTRY} >= {
        f"PAGEKV_{n}" for n in ("NATIVE_COPY", "SHM_CLIENT", "TUNE_MALLOC")
    }


def test_every_variable_the_code_reads_is_registered_and_read_through_it():
    """No ``os.environ`` / ``os.getenv`` read of a PAGEKV_ name outside the registry (the serve
    settings' PAGEKV_<SETTING> are read by the settings module, by their generated names)."""
    registered = {var.name for var in env.REGISTRY}
    sources = [p for p in (ROOT / "pagekv").rglob("*.py") if p.name != "env.py"]
    named = set()
    for path in sources:
        text = path.read_text()
        named |= set(re.findall(r"PAGEKV_[A-Z][A-Z0-9_]*", text))
        hand = re.findall(r"(?:environ(?:\.get)?|getenv)\(\s*[\"'](PAGEKV_\w+)", text)
        hand += re.findall(r"environ\[[\"'](PAGEKV_\w+)", text)
        assert not hand, f"{path.relative_to(ROOT)} reads {hand} by hand: use pagekv.env"
    from pagekv.store.cli.serve import serve_settings

    settings = {s.env_var for s in serve_settings()}
    assert named <= registered | settings, named - registered - settings


def test_the_readme_tables_are_generated_from_the_code():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py"), "--check"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    readme = (ROOT / "README.md").read_text()
    assert env.markdown() in readme
    for var in env.REGISTRY:
        assert f"`{var.name}`" in readme
