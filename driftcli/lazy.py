"""Package attributes imported on first use.

A package's ``__init__`` names what it exports and the module each name lives in; the module
is imported only when the name is first used. ``drift --help`` and ``drift formats`` then
never import torch (about a second and 300 MB), and ``import driftcli`` costs nothing until
the API is used.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any


def exports(namespace: dict[str, Any], table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the package whose globals are ``namespace``: ``name``
    comes from the module ``table[name]``, imported then, and stays in ``namespace``."""
    package = namespace["__name__"]
    shadowed = sorted(set(table) & {m.name for m in pkgutil.iter_modules(namespace["__path__"])})
    if shadowed:  # importing the submodule would replace the export with the module
        raise ImportError(f"{package} exports {', '.join(shadowed)}, which are also its "
                          "submodules: rename one of them")

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
