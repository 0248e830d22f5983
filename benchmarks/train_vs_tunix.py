"""Trainer against Tunix (google-tunix 0.1.7, its own venv: bash benchmarks/setup_tunix.sh), one run,
the same tiny Qwen3-like model (vocab 512, d_model 256, 4 layers, 4 query / 2 KV heads, head_dim 64,
MLP 1024, tied embeddings, fp32) on 8 simulated CPU devices, train pool 0-3, rollout pool 4-7:

  W3  one GRPO AdamW step on 64 sequences x 96 tokens (32 prompt + 64 completion): train tokens/s
      vs Tunix's jitted train step (PeftTrainer + grpo_loss_fn),              goal >= 1.2x
      and vs the step's matmul-rate limit measured in the same run (matmul_chain: the step's weight
      matmuls alone, forward and both gradient products, at its shapes, partitioned as it is),
      interleaved in rounds: limit = tokens * rate / (6 * params * tokens + attention FLOPs).
                                                                              aim >= 80%
      On one device (train pool of meshes/cpu-1-1.yaml) and on the 2 x 2 train mesh.
  W4  one full GRPO step: 8 prompts x 8 samples, 32-token prompts, 64 new tokens, trivial reward,
      rollout and trainer on different devices: seconds/step of our loop (synchronous, eta 0, and
      async, eta 1) vs Tunix's GRPOLearner (synchronous).                          goal >= 2x
      Twice: on those 2 x 2 meshes, and on one device per pool (train 0, rollout 1: "1+1").

  python benchmarks/train_vs_tunix.py [--only w3|w4] [--steps N] [--readme]  ->  benchmarks/out/train_vs_tunix.json

Each side reports its best (W3: of --steps rounds) or mean (W4) steady-state step after a compiling
first step; with --rounds, W4 keeps each side's fastest round (the machine is shared: the least
disturbed one). --readme rewrites the W3 table in benchmarks/README.md.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from jaxrl_hex import meshes  # noqa: E402

meshes.prepare_cpu_devices(8)  # before JAX starts, as the CLI does

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hex.config import base_config  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.rl.batch import TrainBatch  # noqa: E402
from jaxrl_hex.rl.objectives import make_rl_loss  # noqa: E402
from jaxrl_hex.rl.trainer import Trainer, make_optimizer  # noqa: E402

TINY = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=1024,
            tie_embeddings=True, rope_theta=10000.0)
TUNIX_PY = os.path.join(HERE, ".venv-tunix", "bin", "python")


def pools(mesh_file="cpu-8.yaml"):
  return meshes.build_pools(meshes.load_mesh_file(os.path.join(os.path.dirname(HERE), "meshes", mesh_file)))


def trainer(policy, pool, algo):
  optim = ml_collections.ConfigDict(
      dict(lr=1e-5, warmup_steps=0, end_lr_ratio=1.0, b1=0.9, b2=0.999, weight_decay=0.0, grad_clip=1e9))
  return Trainer(policy, pool, make_optimizer(optim, 100), make_rl_loss(algo, 1.0), policy.init(0))


def grpo_tokens(rng, seqs, prompt, completion, group=8):
  """A GRPO batch: the samples of each group share their prompt."""
  tokens = rng.integers(3, 512, (seqs, prompt + completion)).astype(np.int32)
  tokens[:, :prompt] = np.repeat(tokens[::group, :prompt], group, axis=0)
  return tokens


W3_MESH_FILES = {"1+1": "cpu-1-1.yaml", "2x2": "cpu-8.yaml"}  # W3 layouts: the train pool of each (Tunix: LAYOUTS)


def ours_w3(seqs, prompt, completion, share_prompts=True, layout="2x2", model=TINY, micro_batch_tokens=0):
  """-> (a function timing one GRPO AdamW step of `model` in seconds, the compiling first step's seconds)."""
  policy = Policy.build(model_config(**model))
  algo = base_config().algo
  algo.update(
      dict(loss_agg="token-mean", clip_eps_high=0.2, share_prompts=share_prompts,
           micro_batch_tokens=micro_batch_tokens))
  tr = trainer(policy, pools(W3_MESH_FILES[layout])["train"], algo)
  rng = np.random.default_rng(0)
  n, width = seqs, prompt + completion
  batch = TrainBatch(tokens=grpo_tokens(rng, n, prompt, completion), valid=np.ones((n, width), bool), loss_mask=np.ones(
      (n, completion), bool), behav_logp=np.full((n, completion), -6.0,
                                                 np.float32), rewards=rng.normal(size=n).astype(np.float32),
                     group_ids=np.repeat(np.arange(n // 8), 8).astype(np.int32), versions=np.zeros((n, completion),
                                                                                                   np.int32))
  return timed(lambda: tr.step(batch))


def timed(fn):
  """-> (a function returning fn's seconds per call, the first (compiling) call's seconds)."""

  def run():
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0

  return run, run()


# Activation dims split like their weight's output (or input) dim; the rest are whole.
TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab_out")


def projections(cfg):
  """The step's weight matmuls [tokens, in] x [in, out] as (in axis, out axis, in, out): per layer
  q, k, v, o, gate, up, down; then the (tied) output head."""
  d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.mlp_dim
  layer = [("qkv_embed", "heads", d, q), ("qkv_embed", "kv_heads", d, kv), ("qkv_embed", "kv_heads", d, kv),
           ("heads", "o_embed", q, d), ("mlp_up_embed", "mlp", d, f), ("mlp_up_embed", "mlp", d, f),
           ("mlp", "mlp_down_embed", f, d)]
  return layer * cfg.n_layers + [("embed_out", "vocab_out", d, cfg.vocab_size)]


def matmul_chain(cfg, pool, tokens):
  """The matmul-rate limit of a train step on `pool`: one jitted chain of the step's weight
  matmuls alone, each projection's forward x @ w and its two gradient products g @ w.T and
  x.T @ g, at the step's [tokens, in] shapes and dtype, partitioned as the trainer partitions
  them (weights by the pool's rules, tokens over the batch axes, the gradients reduced to the
  weights' shardings). Every product has its own operands, so XLA merges none.
  -> (a function timing one call in seconds, the chain's FLOPs)."""
  act = lambda axis: ("batch", axis if axis in TENSOR_AXES else None)
  rng = np.random.default_rng(1)
  dt = np.dtype(cfg.dtype)
  put = lambda shape, axes: jax.device_put((rng.standard_normal(shape) * 0.1).astype(dt), pool.sharding(axes, shape))
  inputs, outs, flops = [], [], 0
  for i, o, n_in, n_out in projections(cfg):
    inputs.append((put((tokens, n_in), act(i)), put((n_in, n_out), (i, o)), put((tokens, n_out), act(o))))
    outs.append((pool.sharding(act(o)), pool.sharding(act(i)), pool.sharding((i, o))))
    flops += 6 * tokens * n_in * n_out
  chain = jax.jit(lambda inputs: [(x @ w, g @ w.T, x.T @ g) for x, w, g in inputs], out_shardings=outs)
  return timed(lambda: chain(inputs))[0], flops


def attention_flops(cfg, seqs, width):
  """A step's attention FLOPs: QK^T and PV, 2 * head_dim each per visible (query, key, head),
  times 3 (forward and backward), over each sequence's causal pairs width * (width + 1) / 2."""
  return 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seqs * width * (width + 1) // 2


# W3's step in micro-batches of this many tokens (algo.micro_batch_tokens, 4 of 16 sequences):
# a quarter of the temporaries to fault in a call (see w3_rounds), the same gradients.
W3_MICRO_BATCH_TOKENS = 1536


def w3_rounds(seqs, prompt, completion, rounds, layout, model=TINY):
  """Our step (with and without shared prompts, and without in micro-batches of
  W3_MICRO_BATCH_TOKENS) and its matmul-rate limit on one layout, interleaved in `rounds` rounds
  (ours, limit, ours unshared, limit, ours unshared micro-batched, limit), each program twice in a row,
  as a train loop runs its step; each keeps its best. (Alternating single calls, every call mapped
  its temporaries, 0.9 GB for W3, onto pages this VM had to supply afresh: page faults ~10x
  dearer than a repeated call's, and the unshared step took 2.6 s instead of 1.8.)"""
  cfg = model_config(**model)
  tokens, width = seqs * (prompt + completion), prompt + completion
  params = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(Policy.build(cfg).shapes()))
  model_flops = 6 * params * tokens + attention_flops(cfg, seqs, width)
  shared, shared_first = ours_w3(seqs, prompt, completion, True, layout, model)
  unshared, unshared_first = ours_w3(seqs, prompt, completion, False, layout, model)
  micro, micro_first = ours_w3(seqs, prompt, completion, False, layout, model, W3_MICRO_BATCH_TOKENS)
  chain, chain_flops = matmul_chain(cfg, pools(W3_MESH_FILES[layout])["train"], tokens)
  times = {"ours": [], "unshared": [], "micro": [], "chain": []}
  for _ in range(rounds):
    for side, fn in (("ours", shared), ("chain", chain), ("unshared", unshared), ("chain", chain), ("micro", micro),
                     ("chain", chain)):
      times[side] += [fn(), fn()]
  rate = chain_flops / min(times["chain"])
  limit = tokens * rate / model_flops
  # With shared prompts the step runs each group's prompt once: its own work is fewer FLOPs than 6PT.
  head = cfg.vocab_size * cfg.d_model
  shared_flops = (6 * (params - head) * (seqs // 8 * prompt + seqs * (completion - 1)) + 6 * head * seqs * completion +
                  attention_flops(cfg, seqs, width))
  side = lambda key, first, flops: {
      "step_s": min(times[key]),
      "train_tokens_per_s": tokens / min(times[key]),
      "first_step_s": first,
      "of_limit": tokens / min(times[key]) / limit,
      "model_gflops_run": flops / 1e9,
      "of_limit_of_its_own_flops": flops / rate / min(times[key])
  }
  return {
      "ours": side("ours", shared_first, shared_flops),
      "ours_without_shared_prompts": side("unshared", unshared_first, model_flops),
      "ours_without_shared_prompts_micro_batched": dict(side("micro", micro_first, model_flops),
                                                        micro_batch_tokens=W3_MICRO_BATCH_TOKENS),
      "limit": {
          "train_tokens_per_s": limit,
          "matmul_gflops_per_s": rate / 1e9,
          "chain_s": min(times["chain"]),
          "model_gflops_per_step": model_flops / 1e9,
          "params": params,
          "attention_gflops_per_step": attention_flops(cfg, seqs, width) / 1e9
      }
  }


class IdTokens:
  """Token-id strings ('17 5 300') as text, so prompts are exact token counts."""
  pad_id, eos_id, bos_id, vocab_size = 0, 1, 2, 512

  def encode(self, text):
    return [int(t) for t in text.split()]

  def decode(self, ids):
    return " ".join(str(int(t)) for t in ids if int(t) not in (0, 1))


def w4_task(config):
  """Prompts of 31 random token ids (32 with BOS), a trivial reward (completion length)."""
  from jaxrl_hex.tasks import Task
  rng = np.random.default_rng(0)
  records = [{
      "prompt": " ".join(map(str, rng.integers(3, 512, config.task_args.prompt - 1))),
      "answer": ""
  } for _ in range(256)]
  return Task("w4", records[8:], records[:8], lambda prompt, completion, answer: float(len(completion)), IdTokens())


W4_WORKLOAD = dict(prompts=8, group=8, prompt=32, new=64)  # 8 prompts x 8 samples, 32 + 64 tokens
MESH_FILES = {"2x2": "cpu-8.yaml", "1+1": "cpu-1-1.yaml"}  # W4 layouts (Tunix's side: train_tunix_side.LAYOUTS)


def ours_w4(prompts, group, prompt, new, steps, eta=0, layout="2x2"):
  """The real loop (commands.train: orchestrator, engine on the rollout pool, trainer on the train
  pool, device_put weight sync) for 2 + steps + 1 GRPO steps; seconds/step from the metrics rows of
  the steady steps (the first two compile, the last evaluates). eta = 0 is synchronous like Tunix."""
  import tempfile

  from jaxrl_hex import commands, tasks
  from jaxrl_hex.metrics import read_jsonl
  tasks.BUILTIN["w4"] = "__main__:w4_task"
  cfg = base_config()
  cfg.mesh_file = os.path.join(os.path.dirname(HERE), "meshes", MESH_FILES[layout])
  cfg.task, cfg.task_args = "w4", ml_collections.ConfigDict({"prompt": prompt})
  cfg.model = ml_collections.ConfigDict(dict(cfg.model, **TINY))
  cfg.rollout.update(dict(prompts_per_step=prompts, group_size=group, max_new_tokens=new, max_prompt_len=prompt + 8))
  cfg.algo.update(dict(clip_eps_high=0.2, loss_agg="seq-mean-token-mean", share_prompts=True))  # Tunix GRPO defaults
  cfg.optim.update(dict(lr=1e-5, warmup_steps=0))
  cfg.sft.update(dict(max_steps=0, eval_size=8))
  cfg.train.update(
      dict(steps=steps + 3, max_staleness=eta, eval_size=8, eval_every=10**6, checkpoint_every=10**6, log_every=10**6))
  workdir = tempfile.mkdtemp(prefix="w4-")
  commands.train(cfg, workdir)
  wall = [
      r["wall_s"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
      if r.get("phase") == "train" and "loss" in r
  ]
  return {
      "step_s": (wall[-2] - wall[1]) / steps,
      "first_steps_s": wall[1] - wall[0] if len(wall) > 1 else None,
      "steps": steps,
      "max_staleness": eta
  }


def tunix(which, args, last=None):
  """Tunix's figures from its venv; for W3 without the venv, `last` (the previous run's, marked so)."""
  if not os.path.exists(TUNIX_PY):
    if which == "w3":
      print(f"{TUNIX_PY} is missing (bash benchmarks/setup_tunix.sh): W3 keeps the last run's Tunix figures")
      return last and dict(last, kept_from_last_run=True)
    raise SystemExit(f"{TUNIX_PY} is missing; run: bash benchmarks/setup_tunix.sh")
  out = subprocess.run([TUNIX_PY, os.path.join(HERE, "train_tunix_side.py"), which,
                        json.dumps(args)], capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])["tunix"]


W3_LAYOUT_NAMES = {
    "1+1": "one device (train pool of meshes/cpu-1-1.yaml)",
    "2x2": "2 x 2 (fsdp 2 x tensor 2, train pool of meshes/cpu-8.yaml)"
}


def w3_table(results) -> str:
  """The W3 rows of benchmarks/README.md from the JSON (its `train-w3` block)."""
  rows = [
      "| W3 layout | ours, train tokens/s | limit, train tokens/s (matmul rate) | **ours / limit** | "
      f"without shared prompts / limit | the same in micro-batches of {W3_MICRO_BATCH_TOKENS:,} tokens / limit | "
      "Tunix | ours / Tunix |", "|---|---|---|---|---|---|---|---|"
  ]
  for layout, name in W3_LAYOUT_NAMES.items():
    r = results.get("w3" if layout == "2x2" else "w3_1+1")
    if r is None:
      continue
    ours, unshared, limit, theirs = r["ours"], r["ours_without_shared_prompts"], r["limit"], r.get("tunix")
    micro = r.get("ours_without_shared_prompts_micro_batched")
    micro_cell = f"{micro['of_limit']:.0%} ({micro['train_tokens_per_s']:,.0f})" if micro else "n/a"
    tunix_cell = "n/a" if not theirs else f"{theirs['train_tokens_per_s']:,.0f}" + (
        " (last run's)" if theirs.get("kept_from_last_run") else "")
    ratio = f"{r['ratio_train_tokens_per_s']:.2f}x" if theirs else "n/a"
    rows.append(f"| {name} | {ours['train_tokens_per_s']:,.0f} | {limit['train_tokens_per_s']:,.0f} "
                f"({limit['matmul_gflops_per_s']:.0f} GFLOP/s) | **{ours['of_limit']:.0%}** | "
                f"{unshared['of_limit']:.0%} ({unshared['train_tokens_per_s']:,.0f}) | {micro_cell} | {tunix_cell} | "
                f"{ratio} |")
  return "\n".join(rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", choices=["w3", "w4"])
  ap.add_argument("--steps", type=int, default=3, help="W3: interleaved rounds; W4: steady steps per run")
  ap.add_argument("--readme", action="store_true", help="rewrite the W3 table in benchmarks/README.md")
  ap.add_argument("--keep-tunix", action="store_true", help="W3: reuse the JSON's Tunix figures (marked so)")
  ap.add_argument("--rounds", type=int, default=1,
                  help="W4: interleaved rounds (ours, Tunix, ours async); each side's fastest round counts")
  args = ap.parse_args()
  out = os.path.join(HERE, "out", "train_vs_tunix.json")
  results = json.load(open(out)) if os.path.exists(out) else {}  # --only keeps the other workload's figures
  if args.only in (None, "w3"):
    w3 = dict(seqs=64, prompt=32, completion=64)
    for layout in W3_MESH_FILES:
      key = "w3" if layout == "2x2" else "w3_1+1"
      ours = w3_rounds(**w3, rounds=args.steps, layout=layout)
      print(f"W3 ({layout}) ours: {json.dumps(ours)}", flush=True)
      last = results.get(key, {}).get("tunix")
      theirs = dict(last, kept_from_last_run=True) if args.keep_tunix and last else tunix(
          "w3", dict(w3, steps=args.steps, layout=layout), last)
      results[key] = dict(workload=dict(w3, rounds=args.steps, layout=layout), **ours, tunix=theirs)
      if theirs:
        results[key]["ratio_train_tokens_per_s"] = ours["ours"]["train_tokens_per_s"] / theirs["train_tokens_per_s"]
        results[key]["ratio_without_shared_prompts"] = (ours["ours_without_shared_prompts"]["train_tokens_per_s"] /
                                                        theirs["train_tokens_per_s"])
      print(f"W3 ({layout}) train tokens/s: ours {ours['ours']['train_tokens_per_s']:.0f} "
            f"({ours['ours']['of_limit']:.0%} of the limit {ours['limit']['train_tokens_per_s']:.0f} at "
            f"{ours['limit']['matmul_gflops_per_s']:.0f} GFLOP/s; without shared prompts "
            f"{ours['ours_without_shared_prompts']['train_tokens_per_s']:.0f}, "
            f"{ours['ours_without_shared_prompts']['of_limit']:.0%}; micro-batched "
            f"{ours['ours_without_shared_prompts_micro_batched']['of_limit']:.0%}), tunix "
            f"{theirs['train_tokens_per_s'] if theirs else float('nan'):.0f}")
  for layout in ("2x2", "1+1") if args.only in (None, "w4") else ():
    w4 = dict(W4_WORKLOAD, steps=args.steps, layout=layout)
    runs = [(ours_w4(**w4), tunix("w4", w4), ours_w4(**w4, eta=1)) for _ in range(args.rounds)]
    sync, theirs, overlapped = (min(side, key=lambda r: r["step_s"]) for side in zip(*runs))
    key = "w4" if layout == "2x2" else "w4_1+1"
    results[key] = {
        "workload": w4,
        "ours_sync": sync,
        "ours_async": overlapped,
        "tunix": theirs,
        "speedup_sync": theirs["step_s"] / sync["step_s"],
        "speedup_async": theirs["step_s"] / overlapped["step_s"]
    }
    print(f"W4 ({layout}) seconds/step: ours {sync['step_s']:.2f} synchronous (eta 0), {overlapped['step_s']:.2f} "
          f"async (eta 1); tunix {theirs['step_s']:.2f} -> {results[key]['speedup_sync']:.2f}x / "
          f"{results[key]['speedup_async']:.2f}x faster (goal >= 2x)")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(results, f, indent=2)
  if args.readme:
    from readme_section import write_section  # benchmarks/ is on the path when run as a script
    write_section("train-w3", w3_table(results), "Trainer against Tunix")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
