"""Calibrates the planner's `cpu` catalog entry against measured cpu-8 runs (meshes/cpu-8.yaml).

Measures, on 8 simulated CPU devices and the mesh file's real pools:
  train    the real Trainer's GRPO step (base config loss and AdamW) on the train pool
           (fsdp 2 x tensor 2), for two models and several sequences x seq_len;
  rollout  the engine's jitted decode loop (rollout.slots.decode, DECODE_STEPS steps per call,
           sampling and host sync included) over a KV cache on the rollout pool (data 2 x
           tensor 2), for several batch (sequences per replica) x context sizes.
Writes them as measured-run records (the shapes in jaxrl_hex/planner/calibrate.py), fits the
efficiency factors on the FIT points only and reports the prediction error both in-sample and on
the HELD-OUT points (the honest figure).

  python benchmarks/calibrate_cpu8.py [--rounds 9] [--write] [--refit]
    -> benchmarks/out/cpu8-measured.json (records), benchmarks/out/cpu8-calibration.json (fit, errors)
  --write also puts the fitted factors into the `cpu` entry of jaxrl_hex/planner/catalog.yaml and
  the table into benchmarks/README.md (between the cpu8-calibration markers).

The machine is shared and timings swing 2x: every point is timed once per round, round-robin,
and the median over rounds is kept, so a busy spell lands on all points instead of one.
"""
import argparse
import dataclasses
import functools
import json
import math
import pathlib
import re
import statistics
import sys
import time
import typing

from jaxrl_hex import meshes

meshes.prepare_cpu_devices(8)  # before any JAX operation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hex.config import base_config, load_config_file  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.planner import calibrate as cal  # noqa: E402
from jaxrl_hex.planner.catalog import CATALOG_PATH, EFFICIENCY_FIELDS, load_catalog  # noqa: E402
from jaxrl_hex.rl.batch import TrainBatch  # noqa: E402
from jaxrl_hex.rl.objectives import make_rl_loss  # noqa: E402
from jaxrl_hex.rl.trainer import Trainer, make_optimizer  # noqa: E402
from jaxrl_hex.rollout import slots as S  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
# what cpu-8's train and decode records fit (a batch overhead needs synchronous Ray runs: fleet_plan.py)
FIELDS = tuple(f for f in EFFICIENCY_FIELDS if f != "rollout_overhead_s")

TINY = load_config_file(str(ROOT / "configs" / "arith_grpo.py")).model.to_dict()  # the default arith model
MEDIUM = dict(TINY, vocab_size=512, d_model=256, n_layers=4, head_dim=64, mlp_dim=1024)  # 4.1M params (tiny: 124k)
MODELS = {"tiny": TINY, "medium": MEDIUM}
# (model, sequences, seq_len, held out). Sequences are multiples of 8 (GRPO groups) and of the
# train pool's 2 batch ways; tiny 256 x 16 is the default arith step (32 prompts x 8 samples).
TRAIN_POINTS = [("tiny", 64, 16, False), ("tiny", 256, 16, False), ("tiny", 256, 64, False), ("tiny", 128, 32, True),
                ("medium", 16, 32, False), ("medium", 32, 64, False), ("medium", 16, 128, False),
                ("medium", 32, 32, True), ("medium", 64, 64, True)]
# (model, batch = sequences per replica, mean context, held out)
ROLLOUT_POINTS = [("tiny", 8, 32, False), ("tiny", 128, 32, False), ("tiny", 32, 128, False), ("tiny", 64, 64, True),
                  ("medium", 8, 64, False), ("medium", 64, 64, False), ("medium", 16, 256, False),
                  ("medium", 32, 128, True), ("medium", 128, 32, True)]
DECODE_STEPS = 16  # the engine's default steps_per_sync: decode steps per jitted call


@dataclasses.dataclass
class Point:
  """One operating point: its measured-run record (timing filled in later) and one timed call."""
  record: dict
  run: typing.Callable  # () -> None: one call, finished on the host when it returns
  steps_per_call: int = 1


def pool_fields(pool) -> dict:
  return {"device_type": "cpu", "devices": len(pool.devices), "mesh": dict(pool.axis_sizes)}


@functools.cache
def initial_params(name):
  """(policy, host copy of its initial params): one init compile per model, shared by its points."""
  policy = Policy.build(model_config(**MODELS[name]))
  return policy, jax.device_get(policy.init(0))


def train_point(pool, name, seqs, seq_len, held_out) -> Point:
  """The real Trainer step (GRPO loss, AdamW) on seqs random sequences of seq_len tokens, every
  token valid, the second half the completion, behaviour logprobs those of a uniform policy."""
  model = MODELS[name]
  cfg = base_config()
  policy, params = initial_params(name)
  trainer = Trainer(policy, pool, make_optimizer(cfg.optim, 1000), make_rl_loss(cfg.algo, 1.0), params)
  rng = np.random.default_rng(0)
  c_len = seq_len // 2
  batch = TrainBatch(tokens=rng.integers(3, model["vocab_size"], (seqs, seq_len)).astype(np.int32), valid=np.ones(
      (seqs, seq_len), bool), loss_mask=np.ones((seqs, c_len), bool), behav_logp=np.full(
          (seqs, c_len), -math.log(model["vocab_size"]), np.float32), rewards=rng.integers(0, 2,
                                                                                           seqs).astype(np.float32),
                     group_ids=np.repeat(np.arange(seqs // 8), 8).astype(np.int32), versions=np.zeros((seqs, c_len),
                                                                                                      np.int32))
  record = dict(pool="train", name=f"{name} {seqs}x{seq_len}", held_out=held_out, **pool_fields(pool), model=model,
                seq_len=seq_len, tokens_per_step=seqs * seq_len)
  return Point(record, lambda: trainer.step(batch))  # step() ends in a device_get of its metrics


def _rewind(state, start):
  """Every slot back to `start` cached tokens (ring columns [0, start)) so each call decodes
  over the same contexts; the cache's contents do not change the step's cost."""
  slots, length = state.kv.valid.shape
  full = lambda v: jnp.full((slots,), v, jnp.int32)
  ring = dataclasses.replace(state.kv, valid=jnp.broadcast_to(jnp.arange(length) < start, (slots, length)),
                             t=jnp.int32(start))
  return dataclasses.replace(state, kv=ring, pos=full(start), count=full(0))


def rollout_point(pool, name, batch, context, held_out) -> Point:
  """DECODE_STEPS engine decode steps (rollout.slots.decode, jitted and sharded as the engine
  does) over batch slots per data replica, cached context growing from context - DECODE_STEPS/2
  to context + DECODE_STEPS/2 (mean: context). No slot ever finishes."""
  model = MODELS[name]
  policy, params = initial_params(name)
  cfg = policy.cfg
  slots = batch * pool.axis_sizes.get("data", 1)
  start, length = context - DECODE_STEPS // 2, context + DECODE_STEPS // 2
  param_shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
  layout = S.Layout(slots, length)
  state_shardings = S.state_shardings(pool, cfg, layout)
  replicated = pool.replicated()
  sampling = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

  def calls(params, state, live):
    state = _rewind(state, start)
    return S.decode(policy, sampling, (-1,), DECODE_STEPS, length, params, state, live, False)

  fn = jax.jit(calls, in_shardings=(param_shardings, state_shardings, replicated),
               out_shardings=(state_shardings, replicated), donate_argnums=(1,))
  params = jax.device_put(params, param_shardings)
  state = dataclasses.replace(S.init_state(cfg, layout, cfg.dtype), max_new=jnp.full((slots,), 2**30))
  box = {"state": jax.device_put(state, state_shardings)}  # donated and replaced by every call
  live = np.ones(slots, bool)

  def run():
    box["state"], out = fn(params, box["state"], live)
    steps = jax.device_get(out).steps  # the engine fetches tokens, logprobs and flags every call too
    if steps != DECODE_STEPS:
      raise RuntimeError(f"decode ran {steps} steps, not {DECODE_STEPS}: a slot finished")

  record = dict(pool="rollout", name=f"{name} b{batch} c{context}", held_out=held_out, **pool_fields(pool), model=model,
                batch=batch, context=context)
  return Point(record, run, DECODE_STEPS)


def measure(points, rounds, warmup=2) -> list:
  """Warm up (compile) every point, then time each once per round, round-robin; fills each
  record's step_s (median seconds per step), step_s_all, spread (interquartile range over
  median: the noise) and its throughput field."""
  for p in points:
    for _ in range(warmup):
      p.run()
  times = [[] for _ in points]
  for _ in range(rounds):
    for p, ts in zip(points, times):
      start = time.perf_counter()
      p.run()
      ts.append((time.perf_counter() - start) / p.steps_per_call)
  records = []
  for p, ts in zip(points, times):
    r, step = p.record, statistics.median(ts)
    q1, _, q3 = statistics.quantiles(ts, n=4)
    r.update(step_s=step, step_s_all=[round(t, 6) for t in ts], spread=(q3 - q1) / step)
    if r["pool"] == "train":
      r["tokens_per_s"] = r["tokens_per_step"] / step
    else:
      r["decode_tokens_per_s"] = r["batch"] * r["mesh"].get("data", 1) / step
    records.append(r)
  return records


def build_points(train_points, rollout_points) -> list:
  pools = meshes.build_pools(meshes.load_mesh_file(str(ROOT / "meshes" / "cpu-8.yaml")))
  return ([train_point(pools["train"], *p) for p in train_points] +
          [rollout_point(pools["rollout"], *p) for p in rollout_points])


def fit(records, catalog=None) -> dict:
  """Fit on the records not held out; score every record before and after."""
  catalog = catalog or load_catalog()
  overlay, _ = cal.calibrate([r for r in records if not r["held_out"]], catalog)
  rows = [
      dict(row, name=r["name"], held_out=r["held_out"], spread=r["spread"])
      for r, row in zip(records, cal.error_report(records, catalog, overlay))
  ]
  summary = {}
  for pool in ("train", "rollout"):
    for held in (False, True):
      errs = [row["error_after"] for row in rows if row["pool"] == pool and row["held_out"] == held]
      if errs:
        summary[f"{pool}_{'held_out' if held else 'in_sample'}"] = {"max": max(errs), "mean": sum(errs) / len(errs)}
  before = {f: getattr(catalog["cpu"], f) for f in FIELDS}
  return {"overlay": overlay, "before": before, "rows": rows, "error_after": summary}


def table(result) -> str:
  lines = [
      "| pool | operating point | set | measured ms | spread | predicted before ms | predicted after ms | "
      "error after |", "|---|---|---|---|---|---|---|---|"
  ]
  for r in result["rows"]:
    lines.append(f"| {r['pool']} | {r['name']} | {'held out' if r['held_out'] else 'fit'} | "
                 f"{r['measured_s'] * 1e3:.2f} | {r['spread']:.0%} | {r['predicted_before_s'] * 1e3:.2f} | "
                 f"{r['predicted_after_s'] * 1e3:.2f} | {r['error_after']:.0%} |")
  lines.append("")
  for key, e in result["error_after"].items():
    what = key.replace("_", " ", 1).replace("_", "-")
    lines.append(f"- {what} error after calibration: mean {e['mean']:.0%}, max {e['max']:.0%}")
  for label, factors in (("catalog before", result["before"]), ("fitted", result["overlay"]["devices"]["cpu"])):
    lines.append(f"- {label}: " + ", ".join(f"{k} {factors[k]:.4g}" for k in FIELDS))
  return "\n".join(lines)


def write_catalog(factors, note, path=CATALOG_PATH):
  """Replaces the efficiency lines of the catalog's `cpu` entry (only that entry)."""
  text = path.read_text()
  entry = re.search(r"^  cpu:\n(?:    .*\n?)*", text, flags=re.M)  # up to the first line not indented 4
  pattern = r"(    # fitted by benchmarks/calibrate_cpu8\.py.*\n)?" + "".join(rf"    {f}: .*\n?" for f in FIELDS)
  lines = f"    # fitted by benchmarks/calibrate_cpu8.py {note}\n" + "".join(
      f"    {f}: {factors[f]:.4g}\n" for f in FIELDS)
  block, n = re.subn(pattern, lambda _: lines, entry.group(0)) if entry else ("", 0)
  if n != 1:
    raise SystemExit(f"{path}: the cpu entry's efficiency lines are not where expected; edit by hand")
  path.write_text(text[:entry.start()] + block + text[entry.end():])


def main(argv=None):
  from readme_section import write_section  # benchmarks/ is on the path when run as a script
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=9, help="timed calls per point, >= 2 (the median is kept)")
  ap.add_argument("--warmup", type=int, default=2, help="untimed calls per point first (compiles)")
  ap.add_argument("--write", action="store_true", help="update the catalog's cpu entry and benchmarks/README.md")
  ap.add_argument("--refit", action="store_true", help="fit the records of the last measurement again, measure nothing")
  args = ap.parse_args(argv)
  if args.rounds < 2:
    ap.error("--rounds must be >= 2 (the spread needs quartiles)")
  start = time.perf_counter()
  if args.refit:
    records = json.loads((OUT / "cpu8-measured.json").read_text())["records"]
  else:
    records = measure(build_points(TRAIN_POINTS, ROLLOUT_POINTS), args.rounds, args.warmup)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cpu8-measured.json").write_text(json.dumps({"records": records}, indent=1))
  result = fit(records)
  result["seconds"] = time.perf_counter() - start
  (OUT / "cpu8-calibration.json").write_text(json.dumps(result, indent=1))
  text = table(result)
  print(text)
  if args.write:
    held = result["error_after"]
    note = (f"on {time.strftime('%Y-%m-%d')} (held-out error: train {held['train_held_out']['max']:.0%}, "
            f"rollout {held['rollout_held_out']['max']:.0%} max)")
    write_catalog(result["overlay"]["devices"]["cpu"], note)
    write_section("cpu8-calibration", text, "Planner calibration (cpu-8)")
  print(f"wrote {OUT / 'cpu8-measured.json'}, {OUT / 'cpu8-calibration.json'} ({result['seconds']:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
