"""The embedded demo's policy: ~100k parameters, character vocabulary."""
from jaxrl_hex.models.config import model_config


def get_config():
  return model_config(vocab_size=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256,
                      tie_embeddings=True)
