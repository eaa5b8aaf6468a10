"""pagekv as a KV connector for vLLM 0.32 (``KVConnectorBase_V1``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PagekvConnector",
        "kv_connector_module_path": "pagekv.connector.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": ["tcp://kv-store-0:7400"]}}'

Settings: :mod:`.config`. The scheduler half is :mod:`.scheduler`, the worker half
:mod:`.worker`, the page = one vLLM block of every layer adapter :mod:`.blocks`. Only
``PagekvConnector`` (in :mod:`.connector`) needs vLLM; it is imported on first use, so the
rest of the package can be used and tested without vLLM installed.
"""

from __future__ import annotations

__all__ = ["PagekvConnector"]


def __getattr__(name: str) -> object:
    if name == "PagekvConnector":
        from .connector import PagekvConnector

        return PagekvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
