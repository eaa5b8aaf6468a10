"""SGLang 0.5.23's own HTTP server on a CPU-only machine, for tests/engines/test_sglang_server.py.

    python -m tests.engines.sglang_server <sglang.launch_server flags>

runs what ``python -m sglang.launch_server`` runs (``prepare_server_args``, ``run_server``: the
HTTP server, tokenizer manager, scheduler and detokenizer processes, the model runner, the
cache built by the scheduler), after these stand-ins, applied at import so that the scheduler
and detokenizer processes, which multiprocessing spawns by importing this module again, get
them too:

1. ``SGLANG_USE_CPU_ENGINE=1``: SGLang's own CPU platform (its native attention and layers).
2. torchvision, which cannot load against CPU torch: empty modules (``sglang_env``).
3. ``sgl_kernel``, whose CPU build is not on PyPI and which SGLang's CPU platform imports at
   module level: a module whose every function raises when called. None is called for a
   Llama with ``--attention-backend torch_native``: with no ``torch.ops.sgl_kernel`` SGLang's
   AMX check is False and its fused ops take their ``forward_native`` path.
4. The HiCache host pools' pinned memory and CUDA device⇄host copy kernels:
   ``sglang_stack.install_cpu_stubs`` (byte-for-byte torch copies; see that module).

SGLang's page-hash extension (``hicache_hash_cpp``), which it compiles on first use, is built
before the server starts (``sglang_stack.warm_native_hash``), not by the first prefetch.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from tests.engines import sglang_env

sglang_env.stub_torchvision()


def _stub_sgl_kernel() -> None:
    if "sgl_kernel" in sys.modules:
        return
    module = types.ModuleType("sgl_kernel")
    module.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", None)
    module.__path__ = []

    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name}: no CPU build of sgl_kernel here")

        missing.__name__ = name
        return missing

    module.__dict__["__getattr__"] = getattr_
    sys.modules["sgl_kernel"] = module


_stub_sgl_kernel()

from tests.engines import sglang_stack  # noqa: E402

sglang_stack.install_cpu_stubs()


def main(argv: list[str] | None = None) -> None:
    """``sglang/launch_server.py``'s ``__main__``, with this module as the main module."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    sglang_stack.warm_native_hash()  # SGLang's page-hash extension, built before any prefetch
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
