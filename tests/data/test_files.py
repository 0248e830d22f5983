"""Records read from files by index: every format gives the same rows, a split streams, shards and
resumes through the prompt stream, and bad input is one line naming the file or the field."""
import json
import os
import re

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from jaxrl_hex.data.files import DataFileError, RecordError, Records, open_files
from jaxrl_hex.data.prompts import PromptStream

ROWS = [{"q": f"{i}+{i % 7}=", "a": str(i + i % 7), "n": i} for i in range(40)]
FIELDS = {"task_args.prompt_field": "q", "task_args.answer_field": "a"}
WANT = [{"q": r["q"], "a": r["a"]} for r in ROWS]


def _write(tmp_path, rows=ROWS):
  """The rows in every format read here -> {format: path}."""
  import datasets
  table = pa.Table.from_pylist(rows)
  paths = {f: str(tmp_path / f"rows.{f}") for f in ("jsonl", "parquet", "feather", "arrow")}
  with open(paths["jsonl"], "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line is no record
  pq.write_table(table, paths["parquet"], row_group_size=9)  # 5 row groups
  feather.write_feather(table, paths["feather"])  # the IPC file format, compressed
  with pa.OSFile(paths["arrow"], "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
    writer.write_table(table, max_chunksize=6)  # the IPC stream format, 7 batches
  paths["save_to_disk"] = str(tmp_path / "saved")
  datasets.Dataset.from_list(rows).save_to_disk(paths["save_to_disk"], max_shard_size=200)  # several Arrow files
  return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  return _write(tmp_path_factory.mktemp("files"))


def test_every_format_reads_the_same_rows_in_any_order(files):
  import random
  order = list(range(len(ROWS)))
  random.Random(0).shuffle(order)
  for kind, path in files.items():
    source = open_files(path, "task_args.train_file", FIELDS)
    assert len(source) == len(ROWS), kind
    assert [source[i] for i in order] == [WANT[i] for i in order], kind
  assert len(open_files(f"{files['save_to_disk']}/data-*.arrow", "f", FIELDS)) == len(ROWS)


def test_paths_globs_and_lists_concatenate_in_order(files):
  both = open_files(f"{files['jsonl']}, {files['parquet']}", "f", FIELDS)
  assert list(both) == WANT + WANT
  assert both.where(41) == f"{files['parquet']} row 1"
  assert len(open_files(os.path.join(os.path.dirname(files["jsonl"]), "rows.*"), "f", FIELDS)) == 4 * len(ROWS)


def test_records_view_maps_rows_on_read_and_slices_without_reading(files):
  reads = []

  def record(row):
    reads.append(row["q"])
    return {"prompt": row["q"], "answer": row["a"]}

  records = Records(open_files(files["parquet"], "f", FIELDS), record)
  held_out, train = records[:4], records[4:]
  assert (len(held_out), len(train), reads) == (4, 36, [])
  assert train[0] == {"prompt": "4+4=", "answer": "8"} and train[-1]["prompt"] == "39+4="
  assert [r["prompt"] for r in train[::10]] == ["4+4=", "14+0=", "24+3=", "34+6="]
  with pytest.raises(IndexError):
    train[36]


def test_a_row_the_mapping_refuses_is_named_by_file_and_line(files):

  def record(row):
    if row["q"] == "3+3=":
      raise RecordError("'a' has no final number")
    return row

  for kind, where in (("jsonl", "rows.jsonl:4"), ("parquet", "rows.parquet row 3")):
    with pytest.raises(DataFileError, match=f"{where}: 'a' has no final number"):
      list(Records(open_files(files[kind], "f", FIELDS), record))


def test_the_prompt_stream_over_a_file_is_the_stream_over_the_same_list(files):
  source = Records(open_files(files["arrow"], "f", FIELDS), lambda r: {"prompt": r["q"], "answer": r["a"]})
  listed = [{"prompt": r["q"], "answer": r["a"]} for r in ROWS]
  a, b = PromptStream(source, batch_size=16, seed=3), PromptStream(listed, batch_size=16, seed=3)
  for _ in range(6):  # over two epochs
    assert a.next() == b.next()


def test_file_stream_resumes_exactly_and_host_shards_split_the_file(files):
  source = Records(open_files(files["jsonl"], "f", FIELDS), lambda r: {"prompt": r["q"], "answer": r["a"]})
  stream = PromptStream(source, batch_size=7, seed=1)
  for _ in range(4):
    _, state = stream.next()
  expected = [stream.next()[0] for _ in range(5)]
  resumed = PromptStream(source, batch_size=7, seed=1)
  resumed.set_state(state)
  assert [resumed.next()[0] for _ in range(5)] == expected

  shards = [PromptStream(source, batch_size=4, seed=0, shard_index=k, shard_count=2) for k in range(2)]
  seen = [{r["index"] for _ in range(5) for r in s.next()[0]} for s in shards]  # one epoch each: 20 records
  assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(len(ROWS)))
  assert all(source[r["index"]]["prompt"] == r["prompt"] for r in shards[1].next()[0])


@pytest.mark.parametrize("spec, message", [
    ("missing.parquet", "task_args.train_file: 'missing.parquet' does not exist"),
    ("nothing-*.jsonl", "task_args.train_file: 'nothing-*.jsonl' matches no file"),
    ("", "task_args.train_file is empty"),
])
def test_missing_files_are_one_line(spec, message):
  with pytest.raises(DataFileError, match=re.escape(message)):
    open_files(spec, "task_args.train_file", FIELDS)


def test_bad_files_are_one_line_naming_file_field_and_columns(files, tmp_path):
  csv = tmp_path / "rows.csv"
  csv.write_text("q,a\n1+1=,2\n")
  with pytest.raises(DataFileError, match=r"rows.csv' is not a format read here; name files ending in \.jsonl"):
    open_files(str(csv), "task_args.train_file", FIELDS)
  for kind in ("jsonl", "parquet", "save_to_disk"):
    with pytest.raises(
        DataFileError, match=r"task_args.prompt_field='question': .* has no such column; its columns: "
        r"\[.*'q'.*\]; set --config.task_args.prompt_field to one of them"):
      open_files(files[kind], "task_args.train_file", {"task_args.prompt_field": "question"})
  for name, what in (("bad.parquet", "a Parquet file"), ("bad.feather", "an Arrow IPC file or stream")):
    (tmp_path / name).write_text("q,a\n")
    with pytest.raises(DataFileError, match=f"task_args.train_file: .*{name}' is not {what} \\("):
      open_files(str(tmp_path / name), "task_args.train_file", FIELDS)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(DataFileError, match="task_args.train_file=.*empty.jsonl' holds no records"):
    open_files(str(empty), "task_args.train_file", FIELDS)
  (tmp_path / "plain").mkdir()
  with pytest.raises(DataFileError, match=r"plain is a directory without state.json.*e.g. .*plain/\*\.parquet"):
    open_files(str(tmp_path / "plain"), "task_args.train_file", FIELDS)


def test_bad_jsonl_lines_name_the_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"q": "1+1=", "a": "2"}\n\n{"q": "2+2="}\nnot json\n')
  source = open_files(str(path), "f", FIELDS)
  assert source[0] == {"q": "1+1=", "a": "2"}
  with pytest.raises(DataFileError, match=r"bad.jsonl:3: the record has no 'a' \(its keys: \['q'\]\)"):
    source[1]
  with pytest.raises(DataFileError, match="bad.jsonl:4: expected a JSON object on the line"):
    source[2]
  array = tmp_path / "array.json"
  array.write_text(json.dumps(ROWS))
  with pytest.raises(DataFileError, match=r"array.json:1: expected a JSON object on the line \(a JSON array\?"):
    open_files(str(array), "f", FIELDS)


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
  import datasets
  ds = datasets.Dataset.from_list(ROWS)
  datasets.DatasetDict(train=ds, test=ds).save_to_disk(str(tmp_path / "dd"))
  with pytest.raises(
      DataFileError, match=r"dd holds a DatasetDict \(splits \['train', 'test'\]\); name one split's "
      r"directory, e.g. .*dd/train"):
    open_files(str(tmp_path / "dd"), "task_args.train_file", FIELDS)
  assert list(open_files(str(tmp_path / "dd" / "test"), "f", FIELDS)) == WANT
