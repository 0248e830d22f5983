"""Hugging Face models on whatever JAX device is present: parity per family, and loading a sharded
bf16 checkpoint (seconds, GB/s, peak host staging memory as a share of the checkpoint).

  python benchmarks/hf_models.py [--layers 16 --hidden 2048 --vocab 32000] [--out benchmarks/out/hf_models.json]

Parity: a tiny random model of each family (tests/hf_support.py) against transformers on the CPU,
max |logit difference| in fp32 and 32 greedy tokens, at JAX's default matmul precision and at
"highest" (on GPUs the default may round fp32 matmuls to TF32).
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def parity(families):
  import jax
  import numpy as np
  from hf_support import save_tiny, torch_greedy, torch_logits

  from jaxrl_hex.models.hf import from_hf
  out = {}
  for family in families:
    path = tempfile.mkdtemp()
    model = save_tiny(family, path)
    ids = np.random.default_rng(0).integers(3, 96, (2, 12))
    ref, greedy = torch_logits(model, ids), torch_greedy(model, ids, 32)
    row = {}
    for precision in ("default", "highest"):
      with jax.default_matmul_precision(precision):
        ours = from_hf(path)
        row[precision] = {
            "max_abs_logit_diff": float(np.abs(np.asarray(ours(ids)) - ref).max()),
            "greedy_equal": bool((np.asarray(ours.generate(ids, 32)) == greedy).all())
        }
    out[family] = row
    print(family, row, flush=True)
  return out


def load(layers, hidden, vocab):
  import jax
  import torch
  import transformers

  from jaxrl_hex.models.hf import hf_model_config, load_params, save_hf
  from jaxrl_hex.models.policy import Policy
  path = tempfile.mkdtemp()
  cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4,
                                 num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                 num_key_value_heads=min(8, hidden // 64), head_dim=64, tie_word_embeddings=False)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(cfg)
  model = model.to_empty(device="cpu").to(torch.bfloat16)
  for p in model.parameters():
    p.data.normal_(0, 0.02)
  model.save_pretrained(path, max_shard_size="500MB")
  del model
  files = glob.glob(os.path.join(path, "*.safetensors"))
  size = sum(os.path.getsize(f) for f in files)
  ours = hf_model_config(path)
  policy = Policy.build(ours)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: device, policy.shapes())
  tracemalloc.start()
  t0 = time.perf_counter()
  params = jax.block_until_ready(load_params(path, ours, shardings))
  seconds = time.perf_counter() - t0
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  largest = max(x.nbytes for x in jax.tree.leaves(params))
  t0 = time.perf_counter()
  save_hf(ours, params, tempfile.mkdtemp())
  export_s = time.perf_counter() - t0
  row = {
      "params": sum(x.size for x in jax.tree.leaves(params)),
      "shards": len(files),
      "checkpoint_bytes": size,
      "load_seconds": seconds,
      "load_GBps": size / seconds / 1e9,
      "host_peak_bytes": peak,
      "host_peak_over_checkpoint": peak / size,
      "host_peak_over_largest_tensor": peak / largest,
      "export_seconds": export_s,
      "device": str(jax.devices()[0])
  }
  print(row, flush=True)
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--hidden", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--families", default="llama,qwen2,qwen3,gemma2,gemma3_text")
  ap.add_argument("--out", default="benchmarks/out/hf_models.json")
  args = ap.parse_args()
  result = {"parity": parity(args.families.split(",")), "load": load(args.layers, args.hidden, args.vocab)}
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
