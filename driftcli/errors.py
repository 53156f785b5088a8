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


class CastSpecError(DriftError, ValueError):
    """A cast or scaling that cannot be built as asked."""


class ChoiceError(DriftError, ValueError):
    """A value outside a fixed set of choices (rounding mode, overflow policy, …)."""


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ``"; did you mean a, b?"`` for the closest choices, or an empty string.

    Choices that extend what was typed come first, shortest first (``fp8`` is the start of
    ``fp8_e4m3``, however close ``fp16`` is in spelling), then the closest in spelling.
    """
    pool = list(dict.fromkeys(choices))
    found = sorted((c for c in pool if word and c.startswith(word) and c != word),
                   key=lambda c: (len(c), pool.index(c)))[:n]
    found += [c for c in difflib.get_close_matches(word, pool, n=n, cutoff=0.5)
              if c not in found][:n - len(found)]
    return f"; did you mean {', '.join(found)}?" if found else ""
