"""jaxrl_hex: asynchronous RL post-training for language models on mixed accelerator pools.

Nothing is imported here: lower layers import through this package (docs/concepts.md, Layers)."""
__version__ = "0.2.0"
