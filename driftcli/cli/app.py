"""The ``drift`` app: the typer group and the one place that turns errors into exit codes.

This package is the only place that prints or exits. Library errors
(:class:`DriftError`) become ``error: …`` on stderr and exit code 2, and so do the usage
errors the framework finds (a missing folder, an unknown choice); any other exception is a
drift bug: one ``error: unexpected failure …`` line, its traceback saved to a file the line
names, and exit code 3, so that 1 keeps meaning "a rule broke" to CI (Ctrl-C is typer's exit
code 130). Set ``DRIFT_DEBUG=1`` to see the traceback instead. Python warnings print as one
``warning: …`` line.

The command modules import only what their options need (typer, rich and drift's
torch-free modules); the library is imported when a command runs, so ``drift --help``,
``drift CMD --help`` and ``drift formats`` start without torch.
"""

from __future__ import annotations

import functools
import logging as std_logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from typer.core import TyperCommand, TyperGroup

from driftcli.errors import DriftError
from driftcli.escaping import for_terminal

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FOUND = 1
"""The measurement ran and found what it was asked to fail on."""
EXIT_USAGE = 2
"""Bad input or usage."""
EXIT_CRASH = 3
"""An unexpected failure: an exception that is not a :class:`DriftError` (a drift bug)."""

SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Measure", ("clip-rate", "underflow-rate", "error-bias", "cast-diff", "accum-error",
                 "grad-cosine", "block-stats", "advise")),
    ("Verify", ("verify-formats", "formats", "calibrate")),
    ("Quantized checkpoints", ("inspect", "dequantize", "te-dumps")),
    ("Report", ("report",)),
    ("Train and probe", ("train", "dump", "probe", "health")),
    ("Try it", ("demo",)),
)
"""How ``drift --help`` groups the commands, in this order."""


def _usage_name(param: Any) -> str:
    """An argument as usage lines write it: ``INPUT...``, ``[DUMP]...``."""
    name = (param.metavar or param.name.upper()).rstrip(".").strip("[]")
    many = "..." if param.nargs != 1 else ""
    return f"{name}{many}" if param.required else f"[{name}]{many}"


def _takes_paths(param: Any) -> bool:
    """Whether a parameter's values are paths (``Path``, ``list[Path]``, ``Path | None``)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    inner = get_args(annotation)
    return annotation is Path or Path in inner or any(Path in get_args(a) for a in inner)


class DriftCommand(TyperCommand):
    """A command whose usage line and argument list read as Unix tools write them, and that
    refuses an empty path before it runs."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # an empty path is the current folder to pathlib ("" -> "."): an unset $CHECKPOINT in
        # CI would walk and measure whatever lies there, so the raw values are looked at first
        try:
            raw, _, _ = self.make_parser(ctx).parse_args(args=list(args))
        except UsageError:
            raw = {}  # the parse below says what is wrong
        for param in self.get_params(ctx):
            given = raw.get(param.name)
            values = given if isinstance(given, list | tuple) else [given]
            if _takes_paths(param) and any(isinstance(v, str) and not v.strip()
                                           for v in values):
                name = (_usage_name(param).strip("[]").replace("]", "").rstrip(".")
                        if param.param_type_name == "argument" else param.opts[0])
                raise UsageError(f"{name} is empty: give a path (an unset variable such as "
                                 "\"$CHECKPOINT\" expands to an empty one)", ctx)
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [_usage_name(p) for p in self.get_params(ctx)
                         if p.param_type_name == "argument"]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                # the name as in the usage line, without typer's <list[Path]>
                args.append((_usage_name(param).strip("[]").replace("]", ""), record[1]))
            else:
                opts.append(record)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class DriftGroup(TyperGroup):
    """The ``drift`` group: commands listed by section, and every usage error one line."""

    def list_commands(self, ctx: Any) -> list[str]:
        ordered = [name for _, names in SECTIONS for name in names]
        return ordered + sorted(set(self.commands) - set(ordered))

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        width = formatter.width - 6 - max(len(n) for n in self.commands)
        listed: set[str] = set()
        for title, names in (*SECTIONS, ("Other", tuple(self.list_commands(ctx)))):
            rows = [(n, self.commands[n].get_short_help_str(width)) for n in names
                    if n in self.commands and n not in listed]
            listed.update(n for n, _ in rows)
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False,
                                windows_expand_args=windows_expand_args, **extra)
        except UsageError as err:
            if isinstance(err, NoArgsIsHelpError):  # bare `drift`: the help, as asked
                typer.echo(err.ctx.get_help() if err.ctx is not None else "")
            else:
                hint = f"; see {err.ctx.command_path} --help" if err.ctx is not None else ""
                typer.echo(for_terminal(f"error: {err.format_message().rstrip('.')}{hint}",
                                        markup=False), err=True)
            code = EXIT_USAGE
        except ClickException as err:
            typer.echo(for_terminal(f"error: {err.format_message()}", markup=False), err=True)
            code = err.exit_code
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            code = EXIT_FOUND
        except Exception as err:  # a bug anywhere in a command: one line, exit 3
            if os.environ.get("DRIFT_DEBUG") == "1":
                raise
            typer.echo(for_terminal(_crash_line(err, args), markup=False), err=True)
            code = EXIT_CRASH
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _crash_line(err: Exception, args: Sequence[str] | None) -> str:
    """The one line of an unexpected failure, its traceback saved to a temporary file (a long
    run's crash may not come again) that the line names."""
    import tempfile
    import traceback

    argv = list(sys.argv[1:] if args is None else args)
    where = f"drift {argv[0]}" if argv and not argv[0].startswith("-") else "drift"
    detail = str(err)
    if len(detail) > 300:  # a message quoting a whole input: the file holds it all
        detail = detail[:299] + "…"
    what = f"{type(err).__name__}: {detail}" if detail else type(err).__name__
    try:
        fd, saved = tempfile.mkstemp(prefix="drift-crash-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(f"drift {' '.join(argv)}\n")
            traceback.print_exception(err, file=fh)
        kept = f"the traceback in {saved}"
    except OSError:
        kept = "run again with DRIFT_DEBUG=1 for the traceback"
    return (f"error: unexpected failure in {where}: {what}; this is a drift bug: please report "
            f"it with {kept}; outputs written before it are intact")


app = typer.Typer(
    name="drift",
    cls=DriftGroup,
    help="Measure what low-precision formats, scaling and rounding do to your tensors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from driftcli import __version__

        typer.echo(f"drift {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version,
        help="Print drift's version and exit."),
) -> None:
    # the group's own options; the commands are registered with @command
    pass


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` to stderr and return the exit to raise (code 2)."""
    typer.echo(for_terminal(f"error: {message}", markup=False), err=True)
    return typer.Exit(EXIT_USAGE)


def _warning_line(message: Warning | str, category: type[Warning], filename: str,
                  lineno: int, file: Any = None, line: str | None = None) -> None:
    typer.echo(for_terminal(f"warning: {message}", markup=False), err=True)


def command(name: str) -> Callable[[F], F]:
    """Register a command whose DriftErrors become a one-line error and exit code 2, and
    whose Python warnings print as one ``warning:`` line each."""

    def register(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            debug = os.environ.get("DRIFT_DEBUG") == "1"
            quiet_third_parties()
            try:
                with warnings.catch_warnings():
                    if not debug:
                        warnings.showwarning = _warning_line
                    return fn(*args, **kwargs)
            except (DriftError, OSError) as err:  # OSError: an input or output path
                if debug:
                    raise
                raise fail(str(err)) from None

        app.command(name, cls=DriftCommand)(wrapper)
        return fn

    return register


def quiet_third_parties() -> None:
    """Keep the progress bars and notices of Hugging Face libraries (transformers' "Loading
    weights" bar) off a drift command's output, unless the environment asks for them."""
    for key in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # transformers imports torchao when it is installed: its notices of CUDA-only extensions
    # it cannot load, and torch's deprecation notice on the enums it registers, are not drift's
    for name in ("torchao", "torch.utils._pytree"):
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    if "transformers" in sys.modules:  # imported already: its settings are read
        logging = sys.modules["transformers"].utils.logging
        logging.disable_progress_bar()
        logging.set_verbosity_error()


def leave(code: int | str | None) -> None:
    """End the process with ``code`` as :func:`sys.exit` would, less the interpreter's teardown.

    Once torch and numba are loaded, tearing the interpreter down (every module's objects
    freed, LLVM's and torch's static destructors) takes 0.5-1 s on a 2-core machine, longer
    than a small command's measurement. Everything a command leaves is complete by then (its
    tables are written atomically and closed), so the exit handlers are run, the output
    streams flushed, and the process ends. Without torch loaded the normal exit is as fast."""
    if "torch" not in sys.modules:
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()  # Ray's shutdown, multiprocessing's, logging's flush
    status = 0 if code is None else code if isinstance(code, int) else 1
    if status == 1 and not isinstance(code, int):
        print(code, file=sys.stderr)  # what sys.exit prints for anything but a number
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: Python's own exit status for it
            status = 120
    os._exit(status)


def main() -> None:
    """Console-script entry point."""
    from driftcli.memory import use_huge_pages

    use_huge_pages()  # before torch's first allocation, which reads it
    try:
        code = app(prog_name="drift")
    except SystemExit as done:
        code = done.code
    leave(code)
