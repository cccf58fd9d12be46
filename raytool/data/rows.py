"""Reading data rows from jsonl / json / parquet files and HF `save_to_disk` folders, each row
located for error messages as `FILE line N` (jsonl: 1-based line) or `FILE row N (0-based)`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from raytool.console import CONSOLE
from raytool.errors import RaytoolError, one_line

log = logging.getLogger(__name__)

_MAX_WARNINGS = 10  # bad rows logged one per line; the rest as a count


class DataError(RaytoolError):
    """A data file or data set that cannot be used; the message names the file (and row)."""


class BadRow(Exception):
    """What is wrong with one row; the loader prefixes the file and row."""


def kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(value), type(value).__name__)


def jsonl_lines(text: str) -> list[tuple[int, object]]:
    """(1-based line number, row) per non-blank line; a line that is not JSON gives a BadRow as its row."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            rows.append((n, BadRow(f"not valid JSON ({exc.msg} at column {exc.colno})")))
    return rows


def _jsonl_rows(text: str) -> list[tuple[str, object]]:
    return [(f"line {n}", row) for n, row in jsonl_lines(text)]


def _parquet_rows(path: Path) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow, which is not installed "
                        "(pip install pyarrow), or give the data as jsonl") from None
    rows: list[tuple[str, object]] = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        rows += [(f"row {len(rows) + i} (0-based)", row) for i, row in enumerate(batch.to_pylist())]
    return rows


def _arrow_folder_rows(path: Path) -> list[tuple[str, object]]:
    """An HF `datasets` `save_to_disk` folder: its data-*.arrow shards (Arrow IPC streams), in order."""
    import pyarrow as pa

    shards = sorted(path.glob("*.arrow"))
    if not shards:
        raise DataError(f"{path}: a folder, but no *.arrow files in it (expected an HF save_to_disk folder; for a DatasetDict, name a split's folder)")
    rows: list[tuple[str, object]] = []
    for shard in shards:
        with pa.memory_map(str(shard)) as source:
            table = pa.ipc.open_stream(source).read_all()
        rows += [(f"row {len(rows) + i} (0-based)", row) for i, row in enumerate(table.to_pylist())]
    return rows


def read_rows(path: Path) -> list[tuple[str, object]]:
    """(location, row) for every row of a .jsonl / .json / .parquet file or an HF save_to_disk folder;
    a line that is not JSON gives a BadRow as its row. Raises DataError naming the file."""
    if path.is_dir():
        try:
            return _arrow_folder_rows(path)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot read the folder ({one_line(exc)})") from exc
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{path}: unknown data file type '{suffix}'; expected .jsonl, .json, .parquet or an HF save_to_disk folder")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        if suffix == ".parquet":
            return _parquet_rows(path)
        text = path.read_text(encoding="utf-8")
        if suffix == ".json" and text.lstrip().startswith("["):  # one array of rows, not one row per line
            return [(f"row {i} (0-based)", row) for i, row in enumerate(json.loads(text))]
        return _jsonl_rows(text)
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON / parquet (ArrowInvalid is a ValueError)
        raise DataError(f"{path}: cannot read the file ({one_line(exc)})") from exc



def _json(value, key: str, expected: type):
    """`value` as a list or an object (`expected`), decoding it first where it is a JSON string
    (as parquet stores nested data)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRow(f"'{key}' is a string but not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, expected):
        raise BadRow(f"'{key}' must be {kind(expected())}, got {kind(value)}")
    return value


def json_list(value, key: str) -> list:
    return _json(value, key, list)


def json_object(value, key: str) -> dict:
    return _json(value, key, dict)


def convert_rows(path: Path, rows: list[tuple[str, object]], convert, what: str) -> tuple[list, list[str]]:
    """`convert(row, source)` of every row `read_rows(path)` gave (source: `FILE line N` / `FILE
    row N (0-based)`), and one line per row it refused with a BadRow (`source: why`), which is
    skipped. Raises DataError when no row is usable (`what`: how the message names one)."""
    items, problems = [], []
    for where, row in rows:
        source = f"{path} {where}"
        try:
            if isinstance(row, BadRow):
                raise row
            items.append(convert(row, source))
        except BadRow as exc:
            problems.append(f"{source}: {exc}")
    warn_each(problems, str(path))
    if not items:
        why = f"first problem: {problems[0]}" if problems else "the file has no rows"
        raise DataError(f"{path}: no {what} in {len(rows)} rows; {why}")
    log.info("%s: %d rows used, %d skipped", path, len(items), len(problems), extra=CONSOLE)
    return items, problems


def warn_each(problems: list[str], where: str) -> None:
    for problem in problems[:_MAX_WARNINGS]:
        log.warning("skipped %s", problem)
    if len(problems) > _MAX_WARNINGS:
        log.warning("skipped %d more in %s", len(problems) - _MAX_WARNINGS, where)
