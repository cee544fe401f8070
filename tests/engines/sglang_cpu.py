"""Loads sglang's scheduler-side modules in a CPU test process.

sglang 0.5.23 is installed ``--no-deps`` next to vLLM's CPU torch (Makefile). Its scheduler
modules (``sglang.srt.disaggregation.decode``/``prefill`` and their imports) then import on CPU
but for one package: sglang's model configs import ``torchvision`` (for multimodal image
transforms), and the torchvision wheels there are built for the CUDA torch sglang pins, so the
venv has none (the Makefile removes vLLM's, which does not load either). :func:`install_torchvision_standin`
puts a stand-in package on ``sys.meta_path`` of the calling process only: every
``torchvision[.x]`` import gets an empty module whose attributes are placeholders that raise if
called. Nothing on the disaggregation path calls torchvision; a placeholder called would fail loudly.
Call it only in a process of its own (tests/engines/sglang_sched.py's main), never in pytest's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} was called: torchvision is a stand-in in this CPU test process")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # a class deriving from a torchvision class at import time


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attr(name: str, _module: str = spec.name) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder(f"{_module}.{name}")

        module.__getattr__ = attr  # type: ignore[method-assign]
        module.__version__ = "0+kvxferd.standin"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_torchvision_standin() -> None:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _StandinFinder())


def load_sglang() -> None:
    """What an sglang process does before its scheduler starts: sglang's own plugin loader runs
    every ``sglang.srt.plugins`` entry point (ours: kvxfer_client.sglang:register) and applies the
    hooks they registered, then the scheduler's disaggregation modules import (and so bind the
    patched ``TransferBackend`` and ``get_kv_class``)."""
    install_torchvision_standin()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.decode
    import sglang.srt.disaggregation.prefill  # noqa: F401
