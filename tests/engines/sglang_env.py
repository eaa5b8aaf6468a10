"""Import SGLang 0.5.23's HiCache classes in the CPU test venv (scripts/engines/setup_sglang.sh).

The PyPI torchvision wheel does not load against the CPU torch build, so the venv has none; but
``sglang.srt.configs`` (pulled in by the host pools) imports ``torchvision.transforms`` at
module level for image models. We let transformers record "torchvision unavailable" first,
then register empty stand-in modules, test-only. Nothing here is used by the backend itself.
"""

from __future__ import annotations

import sys
import types


def stub_torchvision() -> None:
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached False before the stub exists
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name)
        module.__dict__["__getattr__"] = _missing(name)
        sys.modules[name] = module
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules[
        "torchvision.transforms.functional"
    ]


def _missing(module: str):
    def getattr_(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{module}.{attr}")

    return getattr_


class _Unavailable:
    """Stands for a torchvision object at import time; using it fails loudly."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is stubbed out in the SGLang test venv")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")
