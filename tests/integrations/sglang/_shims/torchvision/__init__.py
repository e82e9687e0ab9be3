"""Import-only stand-in for torchvision in the CPU test environment (.venv-sglang).

SGLang's ``sglang.srt.configs`` package imports every model config eagerly,
and a few multimodal ones import ``torchvision.transforms`` at module level.
PyPI's torchvision wheels are CUDA builds that do not load over the CPU
torch build, so the test environment has no torchvision. This stand-in lets
those imports succeed; any *use* of it raises. The storage, host-pool and
cache-controller code under test never uses torchvision. A real torchvision,
when installed, always wins (conftest.py adds this folder only when
``import torchvision`` would fail).
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+unavailable"
__path__: list = []


class _Unavailable:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Unavailable":
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed in this CPU test environment")

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name: str) -> _Unavailable:
    return _Unavailable(f"torchvision.{name}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision.<anything>`` as a module of ``_Unavailable`` attributes."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = lambda attr, _n=spec.name: _Unavailable(f"{_n}.{attr}")
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
