"""Qwen2-7B shapes (Qwen/Qwen2-7B config.json): ~7.6B parameters.

The released checkpoint pads the vocabulary to 152064 rows (151936 real tokens), so the
embedding shape matches its safetensors.
"""
from jaxrl_hex.models.config import model_config


def get_config():
  return model_config(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                      mlp_dim=18944, tie_embeddings=False, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6,
                      dtype="bfloat16", param_dtype="bfloat16", max_seq_len=32768)
