"""Qwen2-1.5B shapes (Qwen/Qwen2-1.5B config.json): ~1.54B parameters, tied embeddings."""
from jaxrl_hex.models.config import model_config


def get_config():
  return model_config(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                      mlp_dim=8960, tie_embeddings=True, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6,
                      dtype="bfloat16", param_dtype="bfloat16", max_seq_len=32768)
