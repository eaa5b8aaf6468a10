"""Shared bits for pagekv benchmarks: environment facts and result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(
    os.environ.get("RESULTS_DIR", Path(__file__).resolve().parent.parent / "benchmarks" / "results")
)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout
        return out.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PAGEKV_COMMIT", "unknown")


def environment() -> dict[str, Any]:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"env": environment(), **payload}, indent=2) + "\n")
    return path
