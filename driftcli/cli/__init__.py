"""The ``drift`` command: one typer app (:mod:`driftcli.cli.app`), one module per command.

This package is the only place that prints or exits. Importing it registers every command.
"""

# the command modules register themselves on import
from driftcli.cli import (  # noqa: F401
    accum_cmd,
    advise_cmd,
    block_stats_cmd,
    calibrate_cmd,
    demo_cmd,
    formats_cmd,
    grad_cosine_cmd,
    health_cmd,
    measure_cmds,
    quantized_cmds,
    report_cmd,
    te_dumps_cmd,
    train_cmd,
    verify_cmd,
)
from driftcli.cli.app import EXIT_FOUND, EXIT_USAGE, SECTIONS, app, command, fail, main

__all__ = ["EXIT_FOUND", "EXIT_USAGE", "SECTIONS", "app", "command", "fail", "main"]
