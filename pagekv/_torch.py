"""PyTorch for :mod:`pagekv.connector`, :mod:`pagekv.kernels` and :mod:`pagekv.geometry`.

torch is an optional dependency (``pip install 'pagekv[connector]'``): a store node and its
client run without it. The packages that need it import it from here first, so a missing torch
fails with an ``ImportError`` that says what to install instead of a bare module name.
"""

try:
    import torch
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise  # torch is there but broken: its own error says more
    raise ModuleNotFoundError(
        "pagekv.connector, pagekv.kernels and pagekv.geometry need PyTorch, which is not "
        "installed: pip install 'pagekv[connector]' (pagekv.store and the pagekv command do not)",
        name="torch",
    ) from e

__all__ = ["torch"]
