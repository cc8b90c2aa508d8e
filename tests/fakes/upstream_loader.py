"""Importing an upstream engine's own modules without its heavy import graph (in a driver process).

These kinds of stand-in, and nothing else is replaced:
- a *hollow package*: its ``__init__`` is not run (it imports the whole engine: model executors,
  platforms, CUDA probes); its submodules are the real ones, loaded from the extracted wheel;
- an *absent module*: a dependency this environment does not install (``psutil``, ``cbor2``, ...)
  that the imported code names but the tested paths never call, or an engine module that only
  serves the GPU (vLLM's CUDA graph wrapper, imported for a type);
- a name the caller sets on a hollow package or a module (vLLM's "no current config", SGLang's
  C++ page hasher and its runtime-config reads: each driver says which and why).
A name looked up on a hollow package or an absent module that was not set is a stand-in class
whose construction raises ``RuntimeError("stand-in ...")``: a tested path that reached one fails
loudly, it never runs on a fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterable
from typing import Any


class _StandInMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return stand_in(f"{cls.__qualname__}.{name}")


def _refuse(self: object, *args: object, **kwargs: object) -> None:
    raise RuntimeError(f"stand-in {type(self).__qualname__} was used")


def stand_in(qualname: str) -> type:
    """A class standing for an unavailable name: usable in annotations and as a base, never built."""
    return _StandInMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": _refuse, "__qualname__": qualname})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return stand_in(f"{self.__name__}.{name}")


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(name == n or name.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StandInModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(root: str, hollow: Iterable[str], absent: Iterable[str]) -> None:
    """Put ``root`` (an extracted wheel) first on sys.path with the given stand-ins."""
    for name in hollow:
        mod = _StandInModule(name)
        mod.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, mod)
    sys.meta_path.insert(0, _Absent(absent))
    sys.path.insert(0, root)
