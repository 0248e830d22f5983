"""GGUF files (llama.cpp's format) as Hugging Face model directories.

  write_hf_dir("SmolLM2-135M-Instruct.Q4_1.gguf", "out/")   # config.json, model.safetensors, tokenizer

The weights are dequantized with the `gguf` package (pure Python) to float32 (or `dtype`), the q/k
rows llama.cpp interleaves for its RoPE put back in Hugging Face order, and the vocabulary,
merges and control tokens rebuilt as a `tokenizers` byte-level BPE whose pre-tokenizer is the one
`tokenizer.ggml.pre` names. What comes out is a directory every reader of a model_dir takes
(models/hf.py, models/tokenizer.py) and transformers loads without the GGUF.
"""
import dataclasses
import functools
import json
import os
import struct
from importlib.metadata import version

import gguf
import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.families import hf_config
from jaxrl_hex.models.safetensors_files import write_safetensors

MAGIC = b"GGUF"
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFError(UserError):
  """A GGUF file we cannot convert; names the file, the field or tensor, and the fix."""


@dataclasses.dataclass(frozen=True)
class Architecture:
  qkv_bias: bool  # config.json then names Qwen2 (models/families.py)
  permute_qk: bool  # llama.cpp's convert interleaves q/k rows for its non-NeoX RoPE


ARCHITECTURES = {
    "llama": Architecture(qkv_bias=False, permute_qk=True),
    "qwen2": Architecture(qkv_bias=True, permute_qk=False),
}

OUTPUT = ("output.weight", "lm_head.weight")  # absent: the embeddings are tied
SPECIAL_TOKENS = (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))  # ours, tokenizer.ggml's

# The split before byte-level BPE for each tokenizer.ggml.pre, as llama.cpp splits (llama-vocab.cpp)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # name -> (digits one by one first, the split; None: GPT-2's, byte-level BPE's own)
    "gpt-2": (False, None),
    "smollm": (True, None),
    "llama-bpe": (False, LLAMA3_SPLIT),
    "qwen2": (False, QWEN2_SPLIT),
}


def write_hf_dir(path: str, out_dir: str, dtype: str = "float32") -> dict:
  """Writes the GGUF at `path` as a Hugging Face model directory in out_dir (created if missing),
  the weights in `dtype` (DTYPES); every check runs before a file is written. -> its config.json."""
  reader = open_gguf(path)
  meta = _Metadata(reader, path)
  arch = meta.architecture()
  config = _config(meta, arch, {t.name for t in reader.tensors}, dtype)
  tensors = _tensors(reader, meta, arch, config, DTYPES[dtype])
  tokenizer, token_config = _tokenizer(meta, config["max_position_embeddings"])
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(out_dir, tensors)
  tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
  ids = ("bos_token_id", "eos_token_id", "pad_token_id")
  files = {
      "config.json": config,
      "tokenizer_config.json": token_config,
      "generation_config.json": {
          k: config[k] for k in ids if k in config
      }
  }
  for name, contents in files.items():
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(contents, f, indent=2)
  return config


def check_magic(path: str, what: str | None = None):
  """Refuses a file that is not a GGUF at all; what: how the error names it (default: the path)."""
  with open(path, "rb") as f:
    head = f.read(len(MAGIC))
  if head != MAGIC:
    raise GGUFError(f"{what or path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r}); give a .gguf file "
                    "as llama.cpp writes it, or a Hugging Face model directory (config.json, tokenizer, *.safetensors)")


def open_gguf(path: str) -> gguf.GGUFReader:
  check_magic(path)
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, struct.error) as e:
    raise GGUFError(f"{path}: a GGUF header that does not parse ({e}); the file is truncated or corrupt, "
                    "download it again") from None


class _Metadata:
  """The file's key/value metadata by name."""

  def __init__(self, reader, path):
    self.reader, self.path = reader, path

  def get(self, key, default=None):
    field = self.reader.get_field(key)
    return default if field is None else field.contents()

  def need(self, key):
    value = self.get(key)
    if value is None:
      raise GGUFError(f"{self.path}: metadata {key!r} is missing; the file was not written by a llama.cpp converter "
                      "that we read (convert_hf_to_gguf.py)")
    return value

  def architecture(self) -> str:
    name = self.get("general.architecture")
    if name not in ARCHITECTURES:
      raise GGUFError(f"{self.path}: general.architecture={name!r} is not one we load; supported: "
                      f"{', '.join(ARCHITECTURES)}; use a GGUF of such a model, or the model's Hugging Face directory")
    return name


def _config(meta, arch: str, tensor_names: set, dtype: str) -> dict:
  """config.json contents, written through models/families.py as every export of ours is."""
  heads = meta.need(f"{arch}.attention.head_count")
  d = meta.need(f"{arch}.embedding_length")
  head_dim = meta.get(f"{arch}.attention.key_length", d // heads)
  rope_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
  if rope_dims != head_dim:
    raise GGUFError(f"{meta.path}: {arch}.rope.dimension_count={rope_dims} rotates part of each {head_dim}-wide "
                    "head, which the decoder here does not do; use the model's Hugging Face directory")
  scaling = meta.get(f"{arch}.rope.scaling.type", "none")
  if scaling != "none":
    raise GGUFError(f"{meta.path}: {arch}.rope.scaling.type={scaling!r} is not read from GGUF files; use the "
                    "model's Hugging Face directory, whose config.json states the scaling")
  cfg = model_config(vocab_size=meta.get(f"{arch}.vocab_size") or len(meta.need("tokenizer.ggml.tokens")), d_model=d,
                     n_layers=meta.need(f"{arch}.block_count"), n_heads=heads,
                     n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
                     mlp_dim=meta.need(f"{arch}.feed_forward_length"), tie_embeddings=OUTPUT[0] not in tensor_names,
                     rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
                     norm_eps=float(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
                     qkv_bias=ARCHITECTURES[arch].qkv_bias, max_seq_len=meta.get(f"{arch}.context_length", 4096))
  ids = {f"{name}_token_id": meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in SPECIAL_TOKENS}
  return hf_config(cfg, {k: int(v) for k, v in ids.items() if v is not None}, dtype)


@functools.cache
def dequantizes(qtype: gguf.GGMLQuantizationType) -> bool:
  """Whether the installed gguf package dequantizes this tensor type (tried on one zero block)."""
  if qtype not in gguf.GGML_QUANT_SIZES:
    return False
  try:
    gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
  except NotImplementedError:
    return False
  return True


def _tensors(reader, meta, arch: str, config: dict, dtype) -> list:
  """(Hugging Face name, shape, dtype, fetch) for write_safetensors, after checking every tensor's
  name, shape and type; fetch dequantizes one tensor when it is written."""
  expected = _expected(config, ARCHITECTURES[arch])
  by_name = {t.name: t for t in reader.tensors}
  missing = [n for n in expected if n not in by_name]
  if missing:
    raise GGUFError(f"{meta.path}: tensor {missing[0]!r} is missing (and {len(missing) - 1} more); a {arch} model of "
                    "this config needs it: the file is incomplete")
  out = []
  for t in reader.tensors:
    if t.name not in expected:
      raise GGUFError(f"{meta.path}: tensor {t.name!r} has no place in a {arch} model here (it would change the "
                      "model's math); use the model's Hugging Face directory")
    if not dequantizes(t.tensor_type):
      supported = [q.name for q in gguf.GGMLQuantizationType if dequantizes(q)]
      raise GGUFError(f"{meta.path}: tensor {t.name!r} is {t.tensor_type.name}, which gguf {version('gguf')} cannot "
                      f"dequantize; supported: {', '.join(supported)}; re-quantize the model to one of them (e.g. "
                      "llama-quantize --allow-requantize IN OUT Q8_0)")
    name, shape, heads = expected[t.name]
    stored = tuple(int(n) for n in reversed(t.shape))  # ggml lists the fastest dim first
    if stored != shape:
      raise GGUFError(f"{meta.path}: tensor {t.name!r} has shape {list(stored)}, but the file's metadata implies "
                      f"{list(shape)}; the file is inconsistent")
    out.append((name, shape, dtype, functools.partial(_fetch, t, shape, heads, dtype)))
  return out


def _expected(config: dict, spec: Architecture) -> dict:
  """GGUF tensor name -> (Hugging Face name, shape, heads whose q/k rows llama.cpp interleaved or None)."""
  d, v, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
  h, kv = config["num_attention_heads"], config["num_key_value_heads"]
  q, k = h * config["head_dim"], kv * config["head_dim"]
  out = {
      "token_embd.weight": ("model.embed_tokens.weight", (v, d), None),
      "output_norm.weight": ("model.norm.weight", (d,), None)
  }
  if not config["tie_word_embeddings"]:
    out[OUTPUT[0]] = (OUTPUT[1], (v, d), None)
  layer = {
      "attn_q.weight": ("self_attn.q_proj.weight", (q, d), h if spec.permute_qk else None),
      "attn_k.weight": ("self_attn.k_proj.weight", (k, d), kv if spec.permute_qk else None),
      "attn_v.weight": ("self_attn.v_proj.weight", (k, d), None),
      "attn_output.weight": ("self_attn.o_proj.weight", (d, q), None),
      "ffn_gate.weight": ("mlp.gate_proj.weight", (f, d), None),
      "ffn_up.weight": ("mlp.up_proj.weight", (f, d), None),
      "ffn_down.weight": ("mlp.down_proj.weight", (d, f), None),
      "attn_norm.weight": ("input_layernorm.weight", (d,), None),
      "ffn_norm.weight": ("post_attention_layernorm.weight", (d,), None),
  }
  if spec.qkv_bias:
    layer.update({f"attn_{p}.bias": (f"self_attn.{p}_proj.bias", (n,), None) for p, n in zip("qkv", (q, k, k))})
  for i in range(config["num_hidden_layers"]):
    out.update({f"blk.{i}.{g}": (f"model.layers.{i}.{hf}", *rest) for g, (hf, *rest) in layer.items()})
  return out


def _fetch(tensor, shape, heads, dtype) -> np.ndarray:
  w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
  if heads is not None:  # llama.cpp stores each head's rows as (half, 2) pairs; Hugging Face as (2, half)
    w = w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
  return w.astype(dtype)


def _tokenizer(meta, max_length: int) -> tuple:
  """-> (the tokenizers.Tokenizer, tokenizer_config.json contents)."""
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(f"{meta.path}: tokenizer.ggml.model={kind!r} is not read here; supported: 'gpt2' (byte-level "
                    "BPE); use the model's Hugging Face directory, whose tokenizer.json we read")
  pre = meta.get("tokenizer.ggml.pre", "gpt-2")  # files from before the key: GPT-2's split, as transformers reads them
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"{meta.path}: tokenizer.ggml.pre={pre!r} is a split we do not rebuild; supported: "
                    f"{', '.join(PRE_TOKENIZERS)}; use the model's Hugging Face directory")
  tokens = meta.need("tokenizer.ggml.tokens")
  tokenizer = byte_level_bpe(tokens, meta.need("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.token_type"), pre)
  special = {}
  for name, key in SPECIAL_TOKENS:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is not None:
      special[name] = tokenizer.id_to_token(i)
  add = {k: bool(meta.get(f"tokenizer.ggml.add_{k}_token", False)) and k in special for k in ("bos", "eos")}
  single = [special["bos"]] * add["bos"] + ["$A"] + [special["eos"]] * add["eos"]
  tokenizer.post_processor = processors.TemplateProcessing(
      single=single, special_tokens=[(t, tokenizer.token_to_id(t)) for t in single if t != "$A"])
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      **{
          f"{k}_token": t for k, t in special.items()
      },
      "add_bos_token": add["bos"],
      "add_eos_token": add["eos"],
      "clean_up_tokenization_spaces": False,
      "model_max_length": max_length,
  }
  template = meta.get("tokenizer.chat_template")
  if template is not None:
    config["chat_template"] = template
  return tokenizer, config


def byte_level_bpe(tokens: list, merges: list, types: list | None, pre: str) -> Tokenizer:
  """A byte-level BPE over `tokens` (ids in order) and `merges` ("a b" each), as llama.cpp and
  transformers read a GGUF vocabulary: a token stored as raw text is spelled in GPT-2's byte
  alphabet; control tokens (type 3) are special added tokens and user-defined ones (type 4) plain
  added tokens, each matched whole; `pre` names the split before BPE (PRE_TOKENIZERS)."""
  tokenizer = Tokenizer(
      models.BPE({
          _spell(t): i for i, t in enumerate(tokens)
      }, [tuple(m.split(" ")) for m in merges], fuse_unk=False, byte_fallback=False))
  digits, split = PRE_TOKENIZERS[pre]
  steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
  if split is None:
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
  else:
    steps += [
        pre_tokenizers.Split(Regex(split), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ]
  tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
  tokenizer.decoder = decoders.ByteLevel()
  typed = list(zip(tokens, types or ()))
  # a control token outside the alphabet is one llama.cpp mislabels; as an added token it would grow the vocabulary
  tokenizer.add_special_tokens(
      [AddedToken(t, normalized=False, special=True) for t, kind in typed if kind == CONTROL and set(t) <= ALPHABET])
  tokenizer.add_tokens(
      [AddedToken(_spell(t), normalized=False, special=False) for t, kind in typed if kind == USER_DEFINED])
  return tokenizer


def _byte_alphabet() -> dict:
  """GPT-2's byte -> printable character map, which byte-level vocabularies are spelled in."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
  extra = iter(range(256, 512))
  return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


BYTES = _byte_alphabet()
ALPHABET = frozenset(BYTES.values())


def _spell(token: str) -> str:
  return token if set(token) <= ALPHABET else "".join(BYTES[b] for b in token.encode("utf-8"))
