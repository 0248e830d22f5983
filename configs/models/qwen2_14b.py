"""Qwen2-class 14B shapes (Qwen/Qwen2.5-14B config.json, the Qwen2 architecture): ~14.8B parameters.

Vocabulary padded to 152064 rows as in the released checkpoint.
"""
from jaxrl_hex.models.config import model_config


def get_config():
  return model_config(vocab_size=152064, d_model=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
                      mlp_dim=13824, tie_embeddings=False, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-5,
                      dtype="bfloat16", param_dtype="bfloat16", max_seq_len=32768)
