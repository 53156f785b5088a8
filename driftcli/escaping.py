"""Names are data: the one function every terminal line drift prints routes user-derived
text through (tensor names, file names, table metadata, error messages quoting them).

A tensor name is whatever a checkpoint's author wrote. Printed as is, ``[/]`` or
``[bold red]x[/]`` is read as Rich markup (a ``MarkupError`` after the table is written loses
the summary, the error lines and the exit code), and ESC, CSI or OSC sequences (an OSC 52
clipboard write, an erase-line) reach the terminal. This module imports nothing heavy, so the
fast commands can use it.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                     "\u2066-\u2069\ud800-\udfff]")
"""C0 and C1 controls and DEL (ESC starts every terminal sequence; C1's CSI and OSC do on
some terminals; CR and the line separators rewrite or fake a line), the bidirectional
overrides that reorder what a line shows, and lone surrogates (a non-UTF-8 byte of a file
name, as Python decodes it), which cannot be written to a UTF-8 terminal at all."""


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for the byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def for_terminal(text: object, *, markup: bool = True) -> str:
    """``text`` (``str()`` of anything) safe to print: every control character, bidi override
    and lone surrogate shown as its ``\\xNN`` / ``\\uNNNN`` escape, and, with ``markup`` (the
    text goes to a Rich console, table or progress bar), Rich markup escaped so that ``[/]``
    prints as ``[/]``. ``markup=False`` is for lines written with ``typer.echo``, which reads
    no markup."""
    shown = _UNSAFE.sub(_visible, str(text))
    if not markup:
        return shown
    from rich.markup import escape

    return escape(shown)
