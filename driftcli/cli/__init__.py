"""The ``drift`` command: one typer app, one module per command.

This package is the only place that prints or exits. Library errors
(:class:`DriftError`) become ``error: …`` on stderr and exit code 2; set
``DRIFT_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from driftcli.errors import DriftError

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="drift",
    help="Measure what low-precision formats, scaling and rounding do to your tensors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXIT_FOUND = 1
"""The measurement ran and found what it was asked to fail on."""
EXIT_USAGE = 2
"""Bad input or usage."""


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` to stderr and return the exit to raise (code 2)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def command(name: str) -> Callable[[F], F]:
    """Register a command whose DriftErrors become a one-line error and exit code 2."""

    def register(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (DriftError, OSError) as err:  # OSError: an input or output path
                if os.environ.get("DRIFT_DEBUG") == "1":
                    raise
                raise fail(str(err)) from None

        app.command(name)(wrapper)
        return fn

    return register


def main() -> None:
    """Console-script entry point."""
    from driftcli.measures.scan import use_huge_pages

    use_huge_pages()  # before torch's first allocation, which reads it
    sys.exit(app())


# the command modules register themselves on import
from driftcli.cli import (  # noqa: E402, F401
    accum_cmd,
    demo_cmd,
    formats_cmd,
    grad_cosine_cmd,
    measure_cmds,
    report_cmd,
    train_cmd,
    verify_cmd,
)
