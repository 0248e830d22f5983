"""The safetensors format, read by slices and written by streaming, one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} and the raw tensor bytes. Reading memory-maps each file and copies out only the
block asked for, so a host holds the slices its devices need and never a whole model; writing
takes tensors one by one, so exporting holds one tensor at a time. A model directory holds
`model.safetensors`, or shards listed by `model.safetensors.index.json`.
"""
import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from jaxrl_hex.models.families import HFModelError

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_
}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class Entry:
  path: str  # the file holding the tensor
  dtype: np.dtype
  shape: tuple
  start: int  # absolute byte offsets in the file
  end: int


def read_header(path: str) -> dict:
  """name -> Entry, after checking that the file holds every byte its header promises."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    raw = f.read(n) if n is not None and 8 + n <= size else None
  if raw is None:
    raise HFModelError(f"{path} is truncated: {size} bytes, shorter than its own header; re-download or re-export it")
  try:
    header = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError):
    raise HFModelError(f"{path}: the header is not JSON; the file is not safetensors or is corrupt") from None
  header.pop("__metadata__", None)
  entries = {}
  for name, meta in header.items():
    if meta.get("dtype") not in DTYPES:
      raise HFModelError(f"{path}: tensor '{name}' has dtype {meta.get('dtype')!r}; supported: {sorted(DTYPES)}")
    dtype, shape = np.dtype(DTYPES[meta["dtype"]]), tuple(meta["shape"])
    start, end = (8 + n + o for o in meta["data_offsets"])
    if end - start != int(np.prod(shape)) * dtype.itemsize:
      raise HFModelError(f"{path}: tensor '{name}' spans {end - start} bytes but shape {list(shape)} of "
                         f"{meta['dtype']} needs {int(np.prod(shape)) * dtype.itemsize}; the file is corrupt")
    if end > size:
      raise HFModelError(f"{path} is truncated: {size} bytes, but tensor '{name}' ends at byte {end}; "
                         "re-download or re-export it")
    entries[name] = Entry(path, dtype, shape, start, end)
  return entries


class SafetensorsDir:
  """Every tensor of a model directory by name; read(name, box) copies out one block. single: the
  name of an unsharded directory's file (a PEFT adapter's is adapter_model.safetensors)."""

  def __init__(self, model_dir: str, single: str = SINGLE):
    index_path, single = os.path.join(model_dir, INDEX), os.path.join(model_dir, single)
    if os.path.isfile(index_path):
      try:
        with open(index_path) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError):
        raise HFModelError(f"{index_path}: not JSON with a 'weight_map'; re-download it") from None
      by_file = {}
      for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
      self.entries = {}
      for file, names in sorted(by_file.items()):
        path = os.path.join(model_dir, file)
        if not os.path.isfile(path):
          raise HFModelError(f"{path} is missing: {INDEX} puts {len(names)} tensors there (e.g. '{names[0]}'); "
                             "download every shard")
        header = read_header(path)
        absent = [n for n in names if n not in header]
        if absent:
          raise HFModelError(f"{path}: {INDEX} puts tensor '{absent[0]}' in this file but it is not there")
        self.entries.update({n: header[n] for n in names})
    elif os.path.isfile(single):
      self.entries = read_header(single)
    else:
      raise HFModelError(
          f"{model_dir}: neither {os.path.basename(single)} nor {INDEX}; a Hugging Face model directory holds its "
          "weights as safetensors")
    self._maps = {}

  def read(self, name: str, box: tuple) -> np.ndarray:
    """A copy of tensor[box] (box: one slice per dim); touches only the pages under the block."""
    e = self.entries[name]
    if e.path not in self._maps:
      self._maps[e.path] = np.memmap(e.path, np.uint8, mode="r")
    tensor = self._maps[e.path][e.start:e.end].view(e.dtype).reshape(e.shape)
    return np.array(tensor[box])

  def close(self):
    self._maps.clear()


def write_safetensors(out_dir: str, tensors: list, max_shard_bytes: int = 4 << 30, single: str = SINGLE) -> list:
  """tensors: (name, shape, dtype, fetch) with fetch() -> np.ndarray, called once, in order.

  Writes `single` (model.safetensors), or model-0000i-of-0000N.safetensors shards of at most
  max_shard_bytes each plus model.safetensors.index.json, holding one tensor in memory at a time.
  """
  shards, size = [[]], 0
  for t in tensors:
    nbytes = int(np.prod(t[1])) * np.dtype(t[2]).itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += nbytes
  names = [single] if len(shards) == 1 else [
      f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
  ]
  weight_map, total = {}, 0
  for file, shard in zip(names, shards):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, _ in shard:
      nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
      header[name] = {
          "dtype": DTYPE_NAMES[np.dtype(dtype)],
          "shape": list(shape),
          "data_offsets": [offset, offset + nbytes]
      }
      offset += nbytes
      weight_map[name] = file
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    with open(os.path.join(out_dir, file), "wb") as f:
      f.write(struct.pack("<Q", len(raw)) + raw)
      for name, shape, dtype, fetch in shard:
        array = np.ascontiguousarray(fetch())
        if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
          raise ValueError(f"write_safetensors: {name} is {array.dtype}{list(array.shape)}, "
                           f"not the announced {np.dtype(dtype)}{list(shape)}")
        f.write(array.reshape(-1).view(np.uint8).data)
    total += offset
  if len(shards) > 1:
    with open(os.path.join(out_dir, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names
