"""The version of drift: read by the package and, at build time, by ``pyproject.toml``."""

__version__ = "0.1.0"
