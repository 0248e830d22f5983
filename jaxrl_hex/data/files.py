"""Records read from local files by index, never all parsed into memory: JSON Lines, Parquet, Arrow
IPC (.arrow, .feather, .ipc; file or stream format) and directories written by Hugging Face
datasets' `save_to_disk` (its Arrow files, in the order its state.json lists them).

- JSONL: one scan records where each non-blank line starts and ends (16 bytes a record); a read
  parses one line (`os.pread`, so reader threads share no file position).
- Arrow: memory-mapped; a read converts one row of the chosen columns.
- Parquet: decoded a row group at a time, the chosen columns only; the last CACHED_ROW_GROUPS
  stay decoded. A shuffled read of a file with many row groups decodes about one per record (~3 ms
  for 10k GSM8K-sized rows here): write such a split as Arrow, or with small row groups.

`open_files` opens a split (paths, globs, several files) and checks the mapped columns exist;
`Records` is a lazy, sliceable view that turns each row into a task record, so a `Task`'s split
and the prompt stream's grain source can be one of these.
"""
import bisect
import collections
import collections.abc
import glob
import json
import os
import threading
import typing
import weakref
from array import array

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxrl_hex.config import resolve_path
from jaxrl_hex.errors import UserError

FORMATS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",  # what datasets' to_json writes: one object per line
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
CACHED_ROW_GROUPS = 8


class DataFileError(UserError):
  pass


class RecordError(ValueError):
  """A row the task's mapping cannot use; Records adds the file and line or row to the message."""


class _Jsonl:

  def __init__(self, path: str):
    self.path = path
    starts, ends = array("q"), array("q")
    with open(path, "rb") as f:
      pos = 0
      for line in f:
        if line.strip():
          starts.append(pos)
          ends.append(pos + len(line))
        pos += len(line)
    self._starts, self._ends = np.frombuffer(starts, np.int64), np.frombuffer(ends, np.int64)
    self._fd = os.open(path, os.O_RDONLY)
    weakref.finalize(self, os.close, self._fd)
    self._fields = None  # every key
    self.columns = list(self.row(0)) if len(self) else []  # the first record's keys: JSONL has no schema

  def select(self, fields):
    self._fields = sorted(fields)

  def __len__(self):
    return len(self._starts)

  def row(self, i: int) -> dict:
    start, end = int(self._starts[i]), int(self._ends[i])
    try:
      row = json.loads(os.pread(self._fd, end - start, start))
    except (json.JSONDecodeError, UnicodeDecodeError):
      row = None
    if not isinstance(row, dict):
      array_hint = " (a JSON array? write one object per line)" if i == 0 and self._is_array() else ""
      raise DataFileError(f"{self.where(i)}: expected a JSON object on the line{array_hint}")
    if self._fields is None:
      return row
    missing = [f for f in self._fields if f not in row]
    if missing:
      raise DataFileError(f"{self.where(i)}: the record has no {missing[0]!r} (its keys: {list(row)})")
    return {f: row[f] for f in self._fields}

  def _is_array(self) -> bool:
    return os.pread(self._fd, 64, 0).lstrip().startswith(b"[")

  def where(self, i: int) -> str:
    """'path:LINE' of record i (counted only for a message: blank lines are not indexed)."""
    start, line, pos = int(self._starts[i]), 1, 0
    while pos < start:
      chunk = os.pread(self._fd, min(1 << 20, start - pos), pos)
      line, pos = line + chunk.count(b"\n"), pos + len(chunk)
    return f"{self.path}:{line}"


class _Columnar:
  """Arrow or Parquet: rows in blocks (record batches or row groups), found by bisection."""

  def __init__(self, path: str, kind: str):
    self.path = path
    if kind == "parquet":
      self._parquet = pq.ParquetFile(path)
      schema = self._parquet.schema_arrow
      counts = [self._parquet.metadata.row_group(g).num_rows for g in range(self._parquet.num_row_groups)]
      self._blocks = None  # decoded on demand
      self._cache, self._lock = collections.OrderedDict(), threading.Lock()
    else:
      self._parquet, self._blocks = None, _arrow_batches(path)
      schema = self._blocks[0].schema if self._blocks else pa.schema([])
      counts = [b.num_rows for b in self._blocks]
    self.columns = schema.names
    self._starts = np.cumsum([0] + counts).tolist()  # [blocks + 1]
    self._fields = self.columns

  def select(self, fields):
    self._fields = [f for f in self.columns if f in fields]

  def __len__(self):
    return self._starts[-1]

  def row(self, i: int) -> dict:
    b = bisect.bisect_right(self._starts, i) - 1
    block, j = self._block(b), i - self._starts[b]
    return {f: block.column(f)[j].as_py() for f in self._fields}

  def _block(self, b: int):
    if self._parquet is None:
      return self._blocks[b]
    with self._lock:  # prompt-stream threads read concurrently; a ParquetFile is not thread-safe
      if b in self._cache:
        self._cache.move_to_end(b)
      else:
        self._cache[b] = self._parquet.read_row_group(b, columns=self._fields)
        if len(self._cache) > CACHED_ROW_GROUPS:
          self._cache.popitem(last=False)
      return self._cache[b]

  def where(self, i: int) -> str:
    return f"{self.path} row {i}"  # counted from 0, as pyarrow and pandas count


def _arrow_batches(path: str) -> list:
  """The record batches of an Arrow IPC file (random-access format) or stream (what save_to_disk
  writes), memory-mapped: nothing is copied unless the file is compressed."""
  source = pa.memory_map(path)
  try:
    reader = pa.ipc.open_file(source)
    return [reader.get_batch(k) for k in range(reader.num_record_batches)]
  except pa.ArrowInvalid:
    source.seek(0)
  return list(pa.ipc.open_stream(source))


def _saved_dataset(path: str, what: str) -> list[str]:
  """The Arrow files of a directory written by datasets' Dataset.save_to_disk."""
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    with open(os.path.join(path, "dataset_dict.json")) as f:
      splits = json.load(f).get("splits", [])
    raise DataFileError(f"{what}: {path} holds a DatasetDict (splits {splits}); name one split's directory, "
                        f"e.g. {os.path.join(path, splits[0] if splits else 'train')}")
  state = os.path.join(path, "state.json")
  if not os.path.isfile(state):
    raise DataFileError(f"{what}: {path} is a directory without state.json (not written by datasets' save_to_disk); "
                        f"name its files instead, e.g. {os.path.join(path, '*.parquet')}")
  with open(state) as f:
    return [os.path.join(path, d["filename"]) for d in json.load(f)["_data_files"]]


def _paths(spec: str, what: str) -> list[tuple[str, str]]:
  """'a.parquet,dir/*.jsonl,saved_dir' -> [(path, kind)] in the order given, globs sorted."""
  out = []
  for part in filter(None, (p.strip() for p in spec.split(","))):
    if glob.has_magic(part):
      matched = sorted(glob.glob(part))
      if not matched:
        raise DataFileError(f"{what}: {part!r} matches no file; check the pattern (relative to the current directory)")
    else:
      path = resolve_path(part)
      if not os.path.exists(path):
        raise DataFileError(f"{what}: {part!r} does not exist; check the path (relative paths start at the current "
                            "directory)")
      matched = _saved_dataset(path, what) if os.path.isdir(path) else [path]
    for path in matched:
      kind = FORMATS.get(os.path.splitext(path)[1].lower())
      if kind is None:
        raise DataFileError(f"{what}: {path!r} is not a format read here; name files ending in "
                            f"{', '.join(FORMATS)}, or a directory written by datasets' save_to_disk")
      out.append((path, kind))
  if not out:
    raise DataFileError(f"{what} is empty; name a file, e.g. --config.{what}=data/train.parquet")
  return out


class FileSource(collections.abc.Sequence):
  """The rows of one or more files, in order, as dicts of the chosen columns."""

  def __init__(self, files: list):
    self._files = files
    self._starts = np.cumsum([0] + [len(f) for f in files]).tolist()  # [files + 1]

  def __len__(self):
    return self._starts[-1]

  def _locate(self, i: int):
    if not 0 <= i < len(self):
      raise IndexError(i)
    k = bisect.bisect_right(self._starts, i) - 1
    return self._files[k], i - self._starts[k]

  def __getitem__(self, i: int) -> dict:
    f, j = self._locate(i)
    return f.row(j)

  def where(self, i: int) -> str:
    f, j = self._locate(i)
    return f.where(j)


def open_files(spec: str, what: str, fields: dict[str, str]) -> FileSource:
  """spec: comma-separated paths, globs or save_to_disk directories (config field `what`).
  fields: {config field: column} every file must have; only these columns are read."""
  files = []
  for path, kind in _paths(spec, what):
    try:
      f = _Jsonl(path) if kind == "jsonl" else _Columnar(path, kind)
    except OSError as e:
      raise DataFileError(f"{what}: cannot read {path!r} ({e.strerror or e})") from None
    except pa.ArrowInvalid as e:
      name = {"parquet": "a Parquet file", "arrow": "an Arrow IPC file or stream"}[kind]
      raise DataFileError(f"{what}: {path!r} is not {name} ({e})") from None
    if len(f):
      for field, column in fields.items():
        if column not in f.columns:
          raise DataFileError(f"{field}={column!r}: {path} has no such column; its columns: {f.columns}; set "
                              f"--config.{field} to one of them")
      f.select(set(fields.values()))
    files.append(f)
  source = FileSource(files)
  if not len(source):
    raise DataFileError(f"{what}={spec!r} holds no records; name files with at least one row")
  return source


class Records(collections.abc.Sequence):
  """fn(row) for the source's rows in `indices`, computed on each read. A slice is another view,
  so holding out `records[:n]` reads nothing. fn raises RecordError for a row it cannot use."""

  def __init__(self, source: FileSource, fn: typing.Callable[[dict], dict], indices: range | None = None):
    self.source, self.fn = source, fn
    self.indices = range(len(source)) if indices is None else indices

  def __len__(self):
    return len(self.indices)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return Records(self.source, self.fn, self.indices[i])
    return self._read(self.indices[i])

  def __iter__(self):
    return map(self._read, self.indices)

  def _read(self, k: int) -> dict:
    row = self.source[k]
    try:
      return self.fn(row)
    except RecordError as e:
      raise DataFileError(f"{self.source.where(k)}: {e}") from None
