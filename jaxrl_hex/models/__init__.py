"""The decoder family (decoder.py), the policy built from a model config (policy.py), its
shape config (config.py), tokenizers and Hugging Face checkpoint I/O (hf.py)."""
