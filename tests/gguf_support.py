"""Tiny GGUF files written with gguf.GGUFWriter as llama.cpp's converter writes them (shared by
tests/models/test_gguf.py and tests/test_convert.py): random Hugging Face weights, some F32, F16 or
quantized, Llama's q/k rows permuted for llama.cpp's RoPE, and a byte-level BPE with merges, control
tokens and a chat template."""
import os

import numpy as np

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128, context=128)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "The answer is the number of clips she sold altogether in April and May.\n\nThink step by step.",
] * 4


def vocabulary(vocab_size=320):
  """(tokens, token types, merges) of a byte-level BPE trained on TEXTS as SmolLM2's was: digits
  split one by one first, so no merge joins two digits."""
  import json

  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True),
       pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.train_from_iterator(
      TEXTS,
      trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CONTROL,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  model = json.loads(tok.to_str())["model"]
  tokens = sorted(model["vocab"], key=model["vocab"].get)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, [3 if t in CONTROL else 1 for t in tokens], merges


def llama_cpp_permute(w, heads):
  """q/k rows as llama.cpp's convert_hf_to_gguf.py stores them for its RoPE."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(vocab, arch="llama", tied=False, seed=0) -> dict:
  """Random Hugging Face tensors (float32) of the tiny model, norms near 1."""
  rng = np.random.default_rng(seed)
  d, f, q, kv = SHAPE["d_model"], SHAPE[
      "mlp_dim"], SHAPE["n_heads"] * SHAPE["head_dim"], SHAPE["n_kv_heads"] * SHAPE["head_dim"]
  shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
  if not tied:
    shapes["lm_head.weight"] = (vocab, d)
  for i in range(SHAPE["n_layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "self_attn.q_proj.weight": (q, d),
        p + "self_attn.k_proj.weight": (kv, d),
        p + "self_attn.v_proj.weight": (kv, d),
        p + "self_attn.o_proj.weight": (d, q),
        p + "mlp.gate_proj.weight": (f, d),
        p + "mlp.up_proj.weight": (f, d),
        p + "mlp.down_proj.weight": (d, f),
        p + "input_layernorm.weight": (d,),
        p + "post_attention_layernorm.weight": (d,),
    })
    if arch == "qwen2":
      shapes.update({p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))})
  out = {}
  for name, shape in shapes.items():
    if "norm" in name:
      out[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    elif len(shape) == 1:
      out[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    else:
      out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
  return out


# GGUF name (a layer's under blk.N.) -> (Hugging Face name, stored type)
LAYER = {
    "attn_q.weight": ("self_attn.q_proj.weight", "F32"),
    "attn_k.weight": ("self_attn.k_proj.weight", "F32"),
    "attn_v.weight": ("self_attn.v_proj.weight", "Q4_1"),
    "attn_output.weight": ("self_attn.o_proj.weight", "Q8_0"),
    "ffn_gate.weight": ("mlp.gate_proj.weight", "Q4_1"),
    "ffn_up.weight": ("mlp.up_proj.weight", "Q8_0"),
    "ffn_down.weight": ("mlp.down_proj.weight", "Q4_1"),
    "attn_norm.weight": ("input_layernorm.weight", "F32"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "F32"),
    "attn_q.bias": ("self_attn.q_proj.bias", "F32"),
    "attn_k.bias": ("self_attn.k_proj.bias", "F32"),
    "attn_v.bias": ("self_attn.v_proj.bias", "F32"),
}
TOP = {
    "token_embd.weight": ("model.embed_tokens.weight", "Q8_0"),
    "output_norm.weight": ("model.norm.weight", "F32"),
    "output.weight": ("lm_head.weight", "F16"),
}


def write_gguf(path, arch="llama", tied=False, template=TEMPLATE, pre="smollm", seed=0, types=None,
               architecture=None) -> dict:
  """Writes a tiny GGUF at `path` -> the Hugging Face weights it stores, as its types round them.
  types: GGUF name -> type name, overriding the defaults; architecture: general.architecture as
  written (default arch)."""
  import gguf
  tokens, token_types, merges = vocabulary()
  weights = hf_weights(len(tokens), arch, tied, seed)
  heads = {"attn_q.weight": SHAPE["n_heads"], "attn_k.weight": SHAPE["n_kv_heads"]}
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  w = gguf.GGUFWriter(path, architecture or arch)
  w.add_name("tiny")
  w.add_block_count(SHAPE["n_layers"])
  w.add_context_length(SHAPE["context"])
  w.add_embedding_length(SHAPE["d_model"])
  w.add_feed_forward_length(SHAPE["mlp_dim"])
  w.add_head_count(SHAPE["n_heads"])
  w.add_head_count_kv(SHAPE["n_kv_heads"])
  w.add_rope_freq_base(1000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(len(tokens))
  w.add_rope_dimension_count(SHAPE["head_dim"])
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(token_types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_unk_token_id(0)
  w.add_add_bos_token(False)
  if template is not None:
    w.add_chat_template(template)
  names = {g: h for g, h in TOP.items() if not (tied and g == "output.weight")}
  for i in range(SHAPE["n_layers"]):
    names.update({f"blk.{i}.{g}": (f"model.layers.{i}.{h}", t) for g, (h, t) in LAYER.items()})
  stored = {}
  for g, (h, kind) in names.items():
    if h not in weights:
      continue
    kind = gguf.GGMLQuantizationType[(types or {}).get(g, kind)]
    x = weights[h]
    n = heads.get(g.split(".", 2)[-1]) if arch == "llama" else None
    raw = llama_cpp_permute(x, n) if n else x
    if kind == gguf.GGMLQuantizationType.F32:
      w.add_tensor(g, raw)
    elif kind == gguf.GGMLQuantizationType.F16:
      w.add_tensor(g, raw.astype(np.float16))
    else:
      try:
        w.add_tensor(g, gguf.quants.quantize(raw, kind), raw_dtype=kind)
      except NotImplementedError:  # a type the gguf package stores but cannot make: zero blocks
        w.add_tensor(g, np.zeros(gguf.quants.quant_shape_to_byte_shape(raw.shape, kind), np.uint8), raw_dtype=kind)
        continue
    # blocks lie within rows, so rounding commutes with the row permutation
    stored[h] = gguf.quants.dequantize(gguf.quants.quantize(x, kind), kind).reshape(x.shape)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return stored
