"""Llama-3.1-70B shapes (meta-llama/Llama-3.1-70B config.json): ~70.6B parameters.

80 layers of d_model 8192 with grouped-query attention (64 heads, 8 KV heads), a 128k vocabulary
and llama3 RoPE scaling to a 128k context.
"""
from jaxrl_hex.models.config import model_config


def get_config():
  return model_config(
      vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, mlp_dim=28672,
      tie_embeddings=False, qkv_bias=False, rope_theta=500000.0, rope_scaling={
          "rope_type": "llama3",
          "factor": 8.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192
      }, norm_eps=1e-5, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=131072)
