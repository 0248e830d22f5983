"""Hugging Face checkpoints in and out: safetensors + config.json <-> our params on a mesh.

Loading places every tensor straight into its sharding with jax.make_array_from_callback: each
device's block is read from the files on its own (models/safetensors_files), so a host reads
only what its devices hold and never a whole model. Exporting writes one tensor at a time.

  model = from_hf("Qwen2.5-Math-1.5B", mesh=pool)   # an nnx.Module: model(input_ids) -> logits
  to_hf(model, "out/")                                # transformers.AutoModelForCausalLM loads it

fp32 logits match transformers to ~1e-6. On GPUs, JAX's default matmul precision rounds fp32 to
TF32 (measured on an H200: logits off by up to 1.3e-2, greedy tokens still equal); wrap calls in
jax.default_matmul_precision("highest") where fp32 parity matters.
"""
import dataclasses
import functools
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrl_hex import meshes
from jaxrl_hex.models.decoder import causal_mask, init_cache
from jaxrl_hex.models.families import HFModelError, config_from_hf, family_of, hf_config, read_config
from jaxrl_hex.models.model_dir import resolve_model_dir
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.safetensors_files import SINGLE, SafetensorsDir, write_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """One checkpoint tensor as one of our params: ours = (hf.T if transpose else hf).reshape(shape).

  groups lists, for each dim of the (transposed) HF tensor, the dims of ours merged into it:
  q_proj [heads*head_dim, embed] is ours [embed, heads, head_dim] with groups ((0,), (1, 2)).
  """
  hf_name: str
  path: tuple
  shape: tuple
  groups: tuple
  transpose: bool = False

  @property
  def hf_shape(self) -> tuple:
    dims = tuple(math.prod(self.shape[i] for i in g) for g in self.groups)
    return dims[::-1] if self.transpose else dims

  def read(self, ckpt: SafetensorsDir, index: tuple) -> np.ndarray:
    """Our block `index` (one slice per dim), read from the checkpoint alone."""
    index = [slice(*s.indices(n)) for s, n in zip(index, self.shape)]
    box, split, rest = [], [], []
    for g in self.groups:  # a merged dim is read whole in its inner dims, then cut
      lead, inner = index[g[0]], math.prod(self.shape[i] for i in g[1:])
      box.append(slice(lead.start * inner, lead.stop * inner))
      split += [lead.stop - lead.start, *(self.shape[i] for i in g[1:])]
      rest += [slice(None), *(index[i] for i in g[1:])]
    block = ckpt.read(self.hf_name, tuple(box[::-1]) if self.transpose else tuple(box))
    return (block.T if self.transpose else block).reshape(split)[tuple(rest)]

  def to_hf(self, ours: np.ndarray) -> np.ndarray:
    merged = ours.reshape(tuple(math.prod(self.shape[i] for i in g) for g in self.groups))
    return merged.T if self.transpose else merged


def tensor_layouts(cfg) -> list:
  """Every param of models.decoder.Decoder(cfg) with its Hugging Face tensor."""
  d, h, kv, hd, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  out = [TensorMap("model.embed_tokens.weight", ("embed",), (v, d), ((0,), (1,)))]
  # Gemma's post_attention_layernorm follows attention; in Llama/Qwen it is the MLP's input norm
  norms = ({
      "input_layernorm": "attn_norm",
      "post_attention_layernorm": "post_attn_norm",
      "pre_feedforward_layernorm": "mlp_norm",
      "post_feedforward_layernorm": "post_mlp_norm"
  } if cfg.post_norms else {
      "input_layernorm": "attn_norm",
      "post_attention_layernorm": "mlp_norm"
  })
  for i in range(cfg.n_layers):
    p, at = f"model.layers.{i}.", ("layers", i)
    for proj, heads in (("q", h), ("k", kv), ("v", kv)):
      out.append(
          TensorMap(f"{p}self_attn.{proj}_proj.weight", at + ("attn", "w" + proj), (d, heads, hd), ((0,), (1, 2)),
                    True))
      if cfg.qkv_bias:
        out.append(TensorMap(f"{p}self_attn.{proj}_proj.bias", at + ("attn", "b" + proj), (heads, hd), ((0, 1),)))
    out.append(TensorMap(f"{p}self_attn.o_proj.weight", at + ("attn", "wo"), (h, hd, d), ((0, 1), (2,)), True))
    if cfg.qk_norm:
      out += [
          TensorMap(f"{p}self_attn.{n}.weight", at + ("attn", n, "scale"), (hd,), ((0,),)) for n in ("q_norm", "k_norm")
      ]
    out += [TensorMap(f"{p}{hf}.weight", at + (ours, "scale"), (d,), ((0,),)) for hf, ours in norms.items()]
    out += [
        TensorMap(f"{p}mlp.{n}_proj.weight", at + ("mlp", n), (d, f) if n != "down" else (f, d), ((0,), (1,)), True)
        for n in ("gate", "up", "down")
    ]
  out.append(TensorMap("model.norm.weight", ("final_norm", "scale"), (d,), ((0,),)))
  if not cfg.tie_embeddings:
    out.append(TensorMap("lm_head.weight", ("lm_head",), (d, v), ((0,), (1,)), True))
  return out


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _stacked_path(cfg, lay):
  """With cfg.scan_layers, the path of the stacked [L, ...] param holding a layer's tensor; else None."""
  return ("layers",) + lay.path[2:] if cfg.scan_layers and lay.path[0] == "layers" else None


def param_of(cfg, params, lay):
  """The device array of a layout's tensor (one layer's slice of a stacked param)."""
  stacked = _stacked_path(cfg, lay)
  return _get(params, lay.path) if stacked is None else _get(params, stacked)[lay.path[1]]


def load_params(model_dir: str, cfg, shardings) -> dict:
  """The checkpoint's tensors as our params dict, each created in its sharding (a pytree like
  Policy.shapes()) from the blocks its devices hold, converted to cfg.param_dtype."""
  ckpt = SafetensorsDir(model_dir)
  layouts = tensor_layouts(cfg)
  family = family_of(cfg).model_type
  for lay in layouts:  # every check before any read
    entry = ckpt.entries.get(lay.hf_name)
    if entry is None:
      raise HFModelError(f"{model_dir}: tensor '{lay.hf_name}' is missing; the {family} config.json needs it")
    if entry.shape != lay.hf_shape:
      raise HFModelError(f"{entry.path}: tensor '{lay.hf_name}' has shape {list(entry.shape)} but config.json "
                         f"implies {list(lay.hf_shape)}")
  unused = sorted(
      set(ckpt.entries) - {lay.hf_name for lay in layouts} - {"lm_head.weight"} -
      {n for n in ckpt.entries if n.endswith("rotary_emb.inv_freq")})
  if unused:
    raise HFModelError(f"{ckpt.entries[unused[0]].path}: tensor '{unused[0]}' (and {len(unused) - 1} more) is not "
                       f"part of a {family} model with this config.json")
  params = read_tensors(ckpt, layouts, cfg, shardings, cfg.param_dtype)
  ckpt.close()
  return params


def read_tensors(ckpt: SafetensorsDir, layouts: list, cfg, shardings, dtype) -> dict:
  """The layouts' tensors as a params-shaped dict (layers stacked as cfg.scan_layers says), each
  created in its sharding (looked up by path in `shardings`; None: the default device) from the
  blocks its devices hold, converted to dtype."""
  dtype = jnp.dtype(dtype)
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  sharding = lambda path: default if shardings is None else _get(shardings, path)
  params, stacks = {}, {}
  for lay in layouts:
    stacked = _stacked_path(cfg, lay)
    if stacked is not None:  # layers in order: tensor_layouts lists layer 0 first
      stacks.setdefault(stacked, []).append(lay)
      continue
    _set(
        params, lay.path,
        jax.make_array_from_callback(lay.shape, sharding(lay.path),
                                     lambda index, lay=lay: lay.read(ckpt, index).astype(dtype, copy=False)))

  def read_layers(lays, index):  # a block of a stacked param: its layers' blocks, each read on its own
    blocks = [lays[i].read(ckpt, index[1:]) for i in range(*index[0].indices(len(lays)))]
    return np.stack(blocks).astype(dtype, copy=False)

  for path, lays in stacks.items():
    _set(
        params, path,
        jax.make_array_from_callback((len(lays),) + lays[0].shape, sharding(path), functools.partial(read_layers,
                                                                                                     lays)))
  return params


def save_hf(cfg, params, out_dir: str, source_dir: str | None = None, dtype: str | None = None,
            max_shard_bytes: int = 4 << 30, fold=None):
  """Writes params as a Hugging Face model directory: safetensors, config.json and, from
  source_dir (the model it was loaded from), its tokenizer and generation files. fold: see
  write_tensors (models.peft folds adapters into their weights)."""
  config = hf_config(cfg, read_config(source_dir) if source_dir else None, dtype)  # refuses before writing
  os.makedirs(out_dir, exist_ok=True)
  if not write_tensors(cfg, params, tensor_layouts(cfg), out_dir, dtype or cfg.param_dtype, max_shard_bytes, fold=fold):
    return
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  for name in TOKENIZER_FILES if source_dir else ():
    if os.path.isfile(os.path.join(source_dir, name)):
      shutil.copyfile(os.path.join(source_dir, name), os.path.join(out_dir, name))


def write_tensors(cfg, params, layouts: list, out_dir: str, dtype, max_shard_bytes: int = 4 << 30, single: str = SINGLE,
                  fold=None) -> bool:
  """Writes each layout's param (a layer's slice of a stacked one) as its checkpoint tensor in
  dtype, one at a time; fold(layout, array) -> array, if given, transforms it first. Multi-host:
  every process gathers each tensor and process 0 writes. -> whether this process wrote."""
  out_dtype = jnp.dtype(dtype)

  def fetch(lay):
    x = param_of(cfg, params, lay)
    x = x if fold is None else fold(lay, x)
    if not x.is_fully_addressable:  # multi-host: every process gathers, one writes
      return lay.to_hf(np.asarray(multihost_utils.process_allgather(x, tiled=True))).astype(out_dtype)
    return lay.to_hf(np.asarray(jax.device_get(x))).astype(out_dtype)

  tensors = [(lay.hf_name, lay.hf_shape, out_dtype, lambda lay=lay: fetch(lay)) for lay in layouts]
  if jax.process_index() != 0:
    for *_, f in tensors:
      f()
    return False
  write_safetensors(out_dir, tensors, max_shard_bytes, single)
  return True


def generation_config(bos_id: int, eos_ids, pad_id: int, rollout=None, base: dict | None = None) -> dict:
  """generation_config.json contents: the token ids the run's engine uses (a sequence ends at any
  of eos_ids) and, from its rollout section, the sampling it trained under, so that
  transformers' generate() stops and samples as the engine did. base: the source model's file,
  whose other fields are kept. Stop strings are left out: generate() refuses them without a
  tokenizer argument."""
  eos = [int(i) for i in eos_ids]
  out = dict(base or {}, bos_token_id=int(bos_id), eos_token_id=eos[0] if len(eos) == 1 else eos,
             pad_token_id=int(pad_id))
  if rollout is not None:
    out["max_new_tokens"] = int(rollout.max_new_tokens)
    if rollout.temperature > 0:  # top_k 0 and top_p 1 switch those filters off in transformers too
      out.update(do_sample=True, temperature=float(rollout.temperature), top_k=int(rollout.top_k),
                 top_p=float(rollout.top_p), min_p=float(rollout.min_p) or None)
    else:
      out.update(do_sample=False, temperature=None, top_k=None, top_p=None)
  return out


def hf_model_config(model_dir: str, **overrides):
  """Our model config for a Hugging Face model directory; overrides (e.g. dtype) win."""
  return config_from_hf(read_config(model_dir), os.path.join(model_dir, "config.json"), **overrides)


class CausalLM(nnx.Module):
  """A decoder with the Hugging Face calling convention: model(input_ids) -> logits."""

  def __init__(self, decoder, source_dir: str | None = None):
    self.decoder = decoder
    self.source_dir = source_dir  # config.json extras and tokenizer files for to_hf

  @property
  def cfg(self):
    return self.decoder.cfg

  def __call__(self, input_ids, attention_mask=None):
    """input_ids [B, T] (left-padded where attention_mask [B, T] is 0) -> logits [B, T, vocab] fp32."""
    valid = jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return self.decoder(jnp.asarray(input_ids), positions, causal_mask(valid))[0]

  def generate(self, input_ids, max_new_tokens: int):
    """Greedy continuation [B, max_new_tokens] of unpadded prompts [B, P], through the KV cache."""
    graphdef, state = nnx.split(self.decoder)
    return _greedy(graphdef, state, jnp.asarray(input_ids), max_new_tokens)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _greedy(graphdef, state, prompt, max_new):
  model = nnx.merge(graphdef, state)
  b, p = prompt.shape
  total = p + max_new
  slots = jnp.arange(total)
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  mask = jnp.broadcast_to((slots[None, :] <= jnp.arange(p)[:, None])[None], (b, p, total))
  logits, cache = model(prompt, positions, mask, init_cache(model.cfg, b, total), 0)

  def step(carry, t):
    token, cache = carry
    step_mask = jnp.broadcast_to((slots <= p + t)[None, None], (b, 1, total))
    logits, cache = model(token[:, None], jnp.full((b, 1), p + t), step_mask, cache, p + t)
    return (jnp.argmax(logits[:, -1], -1), cache), token

  _, tokens = jax.lax.scan(step, (jnp.argmax(logits[:, -1], -1), cache), jnp.arange(max_new))
  return tokens.T


def _pool(mesh):
  """A meshes.Pool for `mesh`: a Pool as it is, or a jax Mesh under the default rules."""
  if mesh is None or isinstance(mesh, meshes.Pool):
    return mesh
  spec = meshes.PoolSpec("model", tuple(range(mesh.size)), dict(mesh.shape), dict(meshes.DEFAULT_RULES))
  return meshes.Pool(spec, list(mesh.devices.flat))


def from_hf(path: str, mesh=None, param_dtype: str | None = None, dtype: str | None = None,
            scan_layers: bool = False) -> CausalLM:
  """A Hugging Face model directory (or a .gguf file or packaged model: models/model_dir.py) as a
  CausalLM, its weights sharded over `mesh` (a meshes.Pool or a jax Mesh with axes
  data/fsdp/tensor) or on the default device.
  param_dtype / dtype: stored weights / compute; default: the checkpoint's dtype.
  scan_layers: each layer's tensors stacked into [L, ...] params (model.scan_layers)."""
  overrides = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype), ("scan_layers", scan_layers)) if v}
  path = resolve_model_dir(path)
  cfg = hf_model_config(path, **overrides)
  policy = Policy.build(cfg)
  pool = _pool(mesh)
  if pool is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, policy.shapes())
  else:
    shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
  return CausalLM(policy.module(load_params(path, cfg, shardings)), source_dir=path)


def to_hf(model: CausalLM, path: str, dtype: str | None = None, max_shard_bytes: int = 4 << 30):
  """Writes `model` as a Hugging Face model directory that transformers and vLLM load."""
  params = nnx.to_pure_dict(nnx.state(model.decoder))
  save_hf(model.cfg, params, path, model.source_dir, dtype, max_shard_bytes)
