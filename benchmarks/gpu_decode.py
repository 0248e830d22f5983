"""GPU decode check: a ~1B-parameter random-weight bf16 decoder through the engine's decode step.

Reports decode tokens/s and the share of the HBM-bandwidth roofline: bytes one decode step must
read (all weights + the KV cache columns it attends over) / step time, against the
device-to-device copy bandwidth measured here (bytes read + written / time). One JSON object on
stdout, also written to $OUT/gpu_decode.json when OUT is set. Runs in about 1-2 minutes.

  PYTHONPATH=$PWD python3 benchmarks/gpu_decode.py [--slots 64 --prompt 64 --new 192]
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# ~1.0B parameters: 18 layers x 47.2M + 2 x 32000 x 2048 embeddings (untied)
MODEL = dict(vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8, head_dim=128, mlp_dim=5632,
             dtype="bfloat16", param_dtype="bfloat16")


def copy_bandwidth(nbytes, repeats=20) -> float:
  """Bytes read + written per second by a device-to-device copy of an nbytes array."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))  # reads and writes every byte once
  copy(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    x = copy(x)
  x.block_until_ready()
  return 2 * nbytes * repeats / (time.perf_counter() - t0)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--new", type=int, default=192, help="new tokens per sequence (multiple of --chunk)")
  ap.add_argument("--chunk", type=int, default=64, help="decode steps per host hand-back")
  ap.add_argument("--smoke", action="store_true", help="a tiny model, any device: checks the script itself")
  args = ap.parse_args()
  devices = jax.devices()
  print("jax", jax.__version__, "devices:", devices, flush=True)
  model = dict(MODEL, n_layers=2, d_model=256, mlp_dim=512, vocab_size=1024) if args.smoke else MODEL
  if devices[0].platform != "gpu" and not args.smoke:
    sys.exit("gpu_decode: no GPU visible to JAX (jax.devices() above); install jax with its CUDA plugin "
             "(the H200 image has jax + jax-cuda13-plugin) and rerun")

  from jaxrl_hex import meshes
  from jaxrl_hex.models.config import model_config, param_count
  from jaxrl_hex.models.policy import Policy, param_bytes
  from jaxrl_hex.rollout.engine import Engine, Request

  class Tok:  # token ids in, ids out: no text involved
    pad_id, bos_id, eos_id = 0, 1, model["vocab_size"]  # EOS unreachable: every sequence runs its budget

    def decode(self, ids):
      return ""

  cfg = model_config(**model)
  pool = meshes.Pool(meshes.PoolSpec("rollout", (0,), {}, dict(meshes.DEFAULT_RULES)), devices[:1])
  policy = Policy.build(cfg)
  params = policy.init(0, pool.shardings_for(policy.logical_axes(), policy.shapes()))
  engine = Engine(policy, pool, Tok(), args.new, temperature=1.0, slots=args.slots, max_prompt_len=args.prompt,
                  steps_per_sync=args.chunk)
  engine.load_weights(0, params)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, model["vocab_size"], args.prompt - 1).tolist() for _ in range(args.slots)]

  def run(seed):
    """-> (seconds, ring columns attended) of each hand-back (the first includes the prefill)."""
    engine.rng = jax.random.key(seed)
    engine.submit([Request(p) for p in prompts])
    chunks = []
    while engine.pending:
      span = engine._span(engine._t + engine.steps_per_sync)  # what this hand-back's decode reads
      t0 = time.perf_counter()
      engine.poll()
      chunks.append((time.perf_counter() - t0, span))
    return chunks

  t0 = time.perf_counter()
  run(0)  # compiles prefill + decode
  compile_s = time.perf_counter() - t0
  chunks = [c for seed in (1, 2) for c in run(seed)[1:]]  # hand-backs of pure decode steps
  seconds = sum(t for t, _ in chunks)
  step_s = seconds / (len(chunks) * args.chunk)
  bandwidth = copy_bandwidth((2 << 30) if not args.smoke else (64 << 20))
  kv_bytes = engine.memory["kv_cache_bytes"]
  # each step reads every weight and the ring columns its call attends over (rollout.slots: span)
  bytes_per_step = int(param_bytes(params) + kv_bytes * np.mean([span for _, span in chunks]) / engine.length)
  result = dict(device=str(devices[0].device_kind), jax=jax.__version__, params=param_count(cfg), slots=args.slots,
                prompt=args.prompt, new_tokens=args.new, compile_and_first_run_s=round(compile_s, 2),
                decode_step_ms=round(step_s * 1e3, 3), decode_tokens_per_s=round(args.slots / step_s, 1),
                weight_bytes=param_bytes(params), kv_cache_bytes=kv_bytes, bytes_per_step=bytes_per_step,
                achieved_gb_per_s=round(bytes_per_step / step_s / 1e9, 1), copy_gb_per_s=round(bandwidth / 1e9, 1),
                roofline_share=round(bytes_per_step / step_s / bandwidth, 3))
  print(json.dumps(result), flush=True)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gpu_decode.json"), "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
