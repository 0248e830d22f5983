"""Tiny random Hugging Face models of every supported family, made and saved with transformers,
and a tiny trained tokenizer with a chat template (shared by tests/models)."""
import math

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text")
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
# Every feature that changes the math, switched on with a value that shows: windows shorter than
# the test sequences, Llama 3 scaling whose bands fall inside head_dim, scalars unlike head_dim.
FEATURES = {
    "llama": dict(
        rope_theta=500.0, rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=64)),
    "qwen2": dict(rope_theta=1000.0, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000.0),
    "gemma2": dict(sliding_window=6, query_pre_attn_scalar=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=6, sliding_window_pattern=3, query_pre_attn_scalar=12,
                        rope_theta=5000.0, rope_local_base_freq=100.0,
                        rope_scaling=dict(rope_type="linear", factor=2.0)),
}


def hf_config(family, **overrides):
  import transformers
  cls = {
      "llama": transformers.LlamaConfig,
      "qwen2": transformers.Qwen2Config,
      "qwen3": transformers.Qwen3Config,
      "gemma2": transformers.Gemma2Config,
      "gemma3_text": transformers.Gemma3TextConfig
  }[family]
  return cls(**dict(SHAPE, **FEATURES[family], **overrides))


def randomize(model, seed=0):
  """Every parameter random (norms and biases too), at scales that give well-separated logits."""
  import torch
  gen = torch.Generator().manual_seed(seed)
  gemma = model.config.model_type.startswith("gemma")
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
      elif p.ndim == 1:  # biases
        p.copy_(0.2 * noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[-1]))
  return model


def save_tiny(family, path, dtype="float32", max_shard_size=None, seed=0, **overrides):
  """A random tiny model of `family` saved as a Hugging Face directory; returns the torch model."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides), attn_implementation="eager")
  randomize(model, seed).to(getattr(torch, dtype))
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(path, **kwargs)
  return model.eval()


def torch_logits(model, ids):
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(ids))).logits.float().numpy()


def torch_greedy(model, ids, n):
  """n greedy tokens by full recompute: the reference that no cache layout can bend."""
  import torch
  seq = torch.as_tensor(np.asarray(ids))
  with torch.no_grad():
    for _ in range(n):
      seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
  return seq[:, ids.shape[1]:].numpy()


CHAT_TEMPLATE = (  # Qwen's shape: no BOS, <|im_start|>role ... <|im_end|> turns
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BOS_CHAT_TEMPLATE = (  # Llama / Gemma shape: the template writes the BOS itself
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
    "{% else %}{{ '<turn>' + message['role'] + ': ' + message['content'] | trim + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<turn>assistant: ' }}{% endif %}")


def save_tokenizer(path, texts, vocab_size=300, bos=False):
  """A byte-level BPE trained on `texts`, saved as tokenizer.json + tokenizer_config.json."""
  import json
  import os

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  os.makedirs(path, exist_ok=True)
  special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<s>", "<turn>"] if bos else [])
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      texts,
      trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "model_max_length": 512,
      "pad_token": "<|endoftext|>",
      "eos_token": "<|im_end|>",
      "bos_token": "<s>" if bos else None,
      "chat_template": BOS_CHAT_TEMPLATE if bos else CHAT_TEMPLATE
  }
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  return tok.get_vocab_size()
