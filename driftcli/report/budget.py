"""How much of its tables a report reads: a budget of rows and one of decoded bytes, each
checked before the values it bounds are decoded (``driftcli.report.load`` reads the tables).

A table's row count is read from its Parquet footer before any column is read, so a small
file declaring millions of rows of repeated values (a few hundred KB can hold 50 M) is
refused in milliseconds instead of taking gigabytes. So are the bytes its columns decode to:
a few rows can repeat one long string stored once in a Parquet dictionary (50 KB of file,
100 MB of strings, in the tests). The footer's uncompressed page sizes bound the plainly
stored values before anything is read; strings are then read still dictionary-encoded, and
their decoded length summed from the dictionary and the indices, before one is decoded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from driftcli.errors import DriftError


class BudgetError(DriftError):
    """Tables larger than a report reads: the rows or the bytes of a budget."""


class TooManyRowsError(BudgetError):
    """Tables holding more rows than a report reads (see :func:`row_budget`)."""


class TooManyBytesError(BudgetError):
    """Tables decoding to more bytes than a report reads (see :func:`byte_budget`)."""


MAX_ROWS = 1_000_000
"""Rows a report reads at most, summed over its tables (the report's tables, and separately
the baseline's). The largest tables drift writes hold tens of thousands of rows
(a tensor × cast each). Measured on a clip-rate table of 1,000,000 rows (27 columns, a
distinct tensor name a row): the report's peak RSS 1.02 GB against 0.34 GB for a table of 7
rows, about 700 bytes a row, in 6.9 s."""
MAX_ROWS_ENV = "DRIFT_REPORT_MAX_ROWS"
"""The environment variable that sets another row budget."""


MAX_BYTES = 2_000_000_000
"""Bytes a report's tables decode to at most (strings' characters, 8 a number), summed over
its tables (and separately the baseline's). A clip-rate table of :data:`MAX_ROWS` rows decodes to
about 0.4 GB; pandas takes about twice the decoded bytes again (its objects)."""
MAX_BYTES_ENV = "DRIFT_REPORT_MAX_BYTES"
"""The environment variable that sets another byte budget."""


def _budget(variable: str, default: int, what: str) -> int:
    given = os.environ.get(variable)
    if given is None or not given.strip():
        return default
    try:
        value = int(given.replace("_", "").replace(",", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise DriftError(f"{variable}={given!r} is not a positive whole number of {what}; "
                         f"set it to one (the default is {default:,}) or unset it")
    return value


def row_budget() -> int:
    """The rows a report may read: ``DRIFT_REPORT_MAX_ROWS`` where set, else
    :data:`MAX_ROWS`."""
    return _budget(MAX_ROWS_ENV, MAX_ROWS, "rows")


def byte_budget() -> int:
    """The decoded bytes a report may read: ``DRIFT_REPORT_MAX_BYTES`` where set, else
    :data:`MAX_BYTES`."""
    return _budget(MAX_BYTES_ENV, MAX_BYTES, "bytes")


def too_many(path: Path, rows: int, budget: int, total: int) -> TooManyRowsError:
    before = total - budget  # rows the tables read before this one took
    held = f"{rows:,} rows" + (f", with the {before:,} of the tables before it" if before else "")
    return TooManyRowsError(
        f"{path} holds {held}, beyond the {total:,} rows a report reads; report fewer "
        f"tables at a time, or set {MAX_ROWS_ENV} higher if this machine has the memory "
        f"(about 700 bytes a row)")


def too_large(path: Path, size: int, budget: int, total: int, *, bound: bool) -> TooManyBytesError:
    before = total - budget
    held = (f"{'stores up to' if bound else 'decodes to'} {size:,} bytes"
            + (f", with the {before:,} of the tables before it" if before else ""))
    return TooManyBytesError(
        f"{path} {held}, beyond the {total:,} bytes a report reads; report fewer tables at a "
        f"time, or set {MAX_BYTES_ENV} higher if this machine has the memory (pandas takes "
        "about twice as much again)")


def stored_bytes(path: Path) -> int:
    """The uncompressed bytes of every column chunk, from the footer: a bound on what the
    values stored plainly decode to (a dictionary's entries are counted once here)."""
    meta = pq.read_metadata(path)
    return sum(meta.row_group(g).column(c).total_uncompressed_size
               for g in range(meta.num_row_groups) for c in range(meta.num_columns))


def decoded_bytes(table: pa.Table) -> int:
    """The bytes ``table``'s columns take decoded: each dictionary-encoded string once per
    row that refers to it (summed from the dictionary's lengths, nothing decoded), the
    buffers of every other column."""
    import pyarrow.compute as pc

    total = 0
    for col in table.columns:
        for chunk in col.chunks:
            if pa.types.is_dictionary(chunk.type):
                lengths = pc.binary_length(chunk.dictionary)
                total += int(pc.sum(pc.take(lengths, chunk.indices)).as_py() or 0)
                total += 8 * len(chunk)  # the offsets
            else:
                total += chunk.nbytes
    return total


def _strings(schema: pa.Schema) -> list[str]:
    return [f.name for f in schema if pa.types.is_string(f.type)
            or pa.types.is_large_string(f.type) or pa.types.is_binary(f.type)
            or pa.types.is_large_binary(f.type)]


def read_columns(path: Path, schema: pa.Schema, columns: list[str], budget: int | None,
                  total: int | None) -> tuple[pa.Table, int]:
    """``columns`` of the table at ``path``, and the bytes they decode to, refused with
    :class:`TooManyBytesError` beyond ``budget`` (of ``total``) before any string is
    decoded."""
    if budget is not None:
        stored = stored_bytes(path)
        if stored > budget:
            raise too_large(path, stored, budget, total or budget, bound=True)
    table = pq.read_table(path, columns=columns, read_dictionary=_strings(schema))
    size = decoded_bytes(table)
    if budget is not None and size > budget:
        raise too_large(path, size, budget, total or budget, bound=False)
    plain = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
    return table.cast(plain), size
