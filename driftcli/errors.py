"""The exceptions drift raises for problems a user can fix.

Library code raises these; only the CLI turns them into ``error: …`` and an
exit code. Every message names the bad input and, where there is one, the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class DriftError(Exception):
    """A problem with the user's input or request, with a message naming the fix."""


class UnknownFormatError(DriftError, KeyError):
    """A format name that is neither registered nor a valid ``eXmY`` / ``eXmYbZ``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class FormatSpecError(DriftError, ValueError):
    """A custom format (``eXmY``, ``eXmYbZ``) whose widths or bias are impossible."""


class ChoiceError(DriftError, ValueError):
    """A value outside a fixed set of choices (rounding mode, overflow policy, …)."""


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ``"; did you mean a, b?"`` for the closest choices, or an empty string."""
    found = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f"; did you mean {', '.join(found)}?" if found else ""
