"""Multi-turn episodes: KV reuse across turns against re-prefilling the whole history each turn.

A synthetic environment (issue 15): each episode opens with a prompt of 64-127 random tokens,
then the model takes `--turns` turns of exactly `--turn-tokens` tokens each (temperature 1.0, EOS
unreachable, so both arms decode the same tokens) and after every turn but the last the
environment answers with an observation of 16-48 random tokens; the history grows to ~300 tokens.
`--episodes` episodes (groups of `--group` on one prompt) run at once through
rollout.episodes.EpisodeStream on one paged engine (`--slots` slots, blocks for every sequence,
so no held KV is evicted) with rollout.py's model (d_model 256, 4 layers, fp32).

Arms: `reuse` (reuse_kv=True, the Engine default: a held sequence keeps its blocks, a turn runs
only its new tokens through slots.extend) and `re-prefill` (reuse_kv=False: a turn prefills its
whole row). Both arms are one engine, its reuse_kv switched between chunks, so they share the
layout, the weights and the compiled decode programs. Each arm runs once cold (compiles), then
the arms alternate for --repeats rounds; each figure is the arm's best round. Batches depend on
when the environment's worker threads answer, so a round may still meet a new program shape:
its compile seconds (the engine's compile_seconds) are taken out of its time and counted. The
prefill/decode split times the engine's prefill and extend programs to completion (one device
sync after each); decode is the engine's decode_seconds; the rest is host work and the
environment's worker threads. In flight: sampled tokens per decode step.

  python benchmarks/episodes.py [--readme]    # ~2.5 min of CPU time; benchmarks/out/episodes.json
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rollout as bench  # noqa: E402  (the rollout benchmark's model and tokenizer)

COMMAND = "python benchmarks/episodes.py --readme"
ARMS = {"reuse": True, "re-prefill": False}  # name -> Engine(reuse_kv=...)
PROMPT, OBSERVATION = (64, 128), (16, 49)  # token lengths, drawn uniformly from [low, high)


class Synthetic:
  """An episode of random-token observations: the record's prompt, then one observation per
  turn (drawn from the episode's own seed) until `turns` model turns."""

  def __init__(self, turns: int, seed: int):
    self.turns, self.rng = turns, np.random.default_rng(seed)

  def reset(self, record):
    self.n = 0
    return record["prompt"]

  def step(self, text):
    from jaxrl_hex.tasks.environment import Step
    del text  # the model's turn changes nothing here
    self.n += 1
    n = int(self.rng.integers(*OBSERVATION))
    return Step(_text(self.rng.integers(3, bench.MODEL["vocab_size"], n)), done=self.n >= self.turns)


def _text(ids) -> str:
  return " ".join(str(int(i)) for i in ids)


def make_task(records: int, turns: int):
  import itertools

  from jaxrl_hex.tasks.environment import EnvTask
  rng = np.random.default_rng(0)
  split = [{
      "prompt": _text(rng.integers(3, bench.MODEL["vocab_size"],
                                   rng.integers(*PROMPT) - 1))
  } for _ in range(records)]
  seeds = itertools.count()  # a fresh environment per episode, in the stream's order: the same in every run
  return EnvTask("synthetic", split, split, lambda: Synthetic(turns, next(seeds)), tokenizer=bench.IntTokenizer(),
                 max_turns=turns)


def make_engine(args):
  from jaxrl_hex.rollout.engine import Engine

  class Timed(Engine):
    """The engine with its prefill and extend programs timed to completion and their padded
    tokens counted (the program's key holds its rows and width buckets)."""
    prefill_seconds, padded_tokens = 0.0, 0

    def _prefill(self, entries):
      self._timed(super()._prefill, entries)

    def _extend(self, seqs):
      self._timed(super()._extend, seqs)

    def _timed(self, run, arg):
      import jax
      t0, compile_s = time.perf_counter(), self.compile_seconds
      run(arg)
      jax.block_until_ready(self._state)
      self.prefill_seconds += time.perf_counter() - t0 - (self.compile_seconds - compile_s)

    def _run(self, key, *args, **kw):
      if key[0] in ("prefill", "extend"):  # (name, rows, width, ...)
        self.padded_tokens += key[1] * key[2]
      return super()._run(key, *args, **kw)

  pool, policy, params = bench._our_policy()
  # an episode's budget: every turn and every observation after the first prompt
  max_new = args.turns * args.turn_tokens + (args.turns - 1) * (OBSERVATION[1] - 1)
  engine = Timed(policy, pool, bench.IntTokenizer(), max_new, temperature=1.0, slots=args.slots,
                 max_prompt_len=PROMPT[1], eos_ids=(bench.EOS,), steps_per_sync=args.steps_per_sync,
                 kv_page_size=args.page)
  engine.load_weights(0, params)
  return engine


def run_arm(engine, args, arm: str, seed: int) -> tuple[dict, object]:
  """One chunk of --episodes episodes with the arm's reuse_kv -> (its figures, its Rollout)."""
  import jax

  from jaxrl_hex.rollout.episodes import EpisodeStream
  task = make_task(args.episodes // args.group, args.turns)
  assert not engine.held, engine.held  # reuse_kv is read as a turn ends: switched between chunks
  engine.reuse_kv = ARMS[arm]
  before = {
      k: getattr(engine, k)
      for k in ("prefill_tokens", "padded_tokens", "tokens_generated", "decode_steps", "decode_seconds",
                "prefill_seconds", "compile_count", "compile_seconds", "held_evictions", "preemptions")
  }
  stream = EpisodeStream(engine, task, turn_tokens=args.turn_tokens)
  try:
    t0 = time.perf_counter()
    rollout, episodes = stream.run(task.train, args.group, jax.random.key(seed))
    wall = time.perf_counter() - t0
  finally:
    stream.close()
  delta = {k: getattr(engine, k) - v for k, v in before.items()}
  seconds = wall - delta["compile_seconds"]
  n = len(episodes)
  assert all(ep.fault is None and ep.turns == args.turns for ep in episodes), [ep.fault for ep in episodes]
  assert delta["tokens_generated"] == n * args.turns * args.turn_tokens, delta
  history = int(rollout.completion_valid.sum() + rollout.prompt_valid.sum())
  busy = delta["prefill_seconds"] + delta["decode_seconds"]
  return dict(seconds=seconds, wall_s=wall, episodes=n, episodes_per_s=n / seconds,
              model_tokens_per_s=delta["tokens_generated"] / seconds, history_tokens_per_episode=history / n,
              prefill_tokens_per_episode=delta["prefill_tokens"] / n,
              padded_prefill_tokens_per_episode=delta["padded_tokens"] / n, prefill_s=delta["prefill_seconds"],
              decode_s=delta["decode_seconds"], in_flight=delta["tokens_generated"] / delta["decode_steps"],
              other_s=seconds - busy, compiles=delta["compile_count"], compile_s=delta["compile_seconds"],
              held_evictions=delta["held_evictions"], preemptions=delta["preemptions"]), rollout


def measure(args) -> dict:
  engine = make_engine(args)
  cold = {name: run_arm(engine, args, name, 0)[0] for name in ARMS}  # compiles
  rounds, same = {name: [] for name in ARMS}, 0
  for r in range(args.repeats):
    order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))  # alternate which arm goes first
    rollouts = {}
    for name in order:
      figures, rollouts[name] = run_arm(engine, args, name, 1 + r)
      rounds[name].append(figures)
      print(name, {k: round(v, 3) for k, v in figures.items()}, flush=True)
    a, b = (rollouts[name].completion for name in ARMS)
    same += int((a == b).all(1).sum())
  best = {name: min(rounds[name], key=lambda f: f["seconds"]) for name in ARMS}
  return dict(settings=vars(args), cold=cold, rounds=rounds, best=best,
              ratio=best["reuse"]["episodes_per_s"] / best["re-prefill"]["episodes_per_s"],
              round_ratios=[b["seconds"] / a["seconds"] for a, b in zip(*rounds.values())],
              same_episodes=same / (args.repeats * args.episodes))


def table(result) -> str:
  s, best = result["settings"], result["best"]
  rows = [
      f"`{COMMAND}`: {s['episodes']} episodes at once ({s['episodes'] // s['group']} prompts x {s['group']}), "
      f"{s['turns']} turns of {s['turn_tokens']} sampled tokens, prompts of {PROMPT[0]}-{PROMPT[1] - 1} and "
      f"observations of {OBSERVATION[0]}-{OBSERVATION[1] - 1} random tokens; rollout.py's model, one paged engine "
      f"({s['slots']} slots, kv_page_size {s['page']}, steps_per_sync {s['steps_per_sync']}); best of "
      f"{s['repeats']} alternating rounds per arm.", "",
      "| arm | episodes/s | sampled tok/s | history tok / episode | prefill tok / episode (padded) | prefill s "
      "| decode s | other s | in flight | compiles |", "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for name, f in best.items():
    rows.append(f"| {name} | {f['episodes_per_s']:.2f} | {f['model_tokens_per_s']:.0f} | "
                f"{f['history_tokens_per_episode']:.0f} | {f['prefill_tokens_per_episode']:.0f} "
                f"({f['padded_prefill_tokens_per_episode']:.0f}) | {f['prefill_s']:.2f} | {f['decode_s']:.2f} | "
                f"{f['other_s']:.2f} | {f['in_flight']:.1f} | {f['compiles']} |")
  rows += [
      "", f"Reuse / re-prefill: **{result['ratio']:.2f}x** episodes/s (goal >= 1.5x; round by round "
      f"{', '.join(f'{r:.2f}x' for r in result['round_ratios'])}); {result['same_episodes']:.0%} of the episodes "
      "sampled the same tokens in both arms."
  ]
  return "\n".join(rows)


def main():
  from readme_section import report  # benchmarks/ is on the path when run as a script
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--episodes", type=int, default=64)
  ap.add_argument("--group", type=int, default=4, help="episodes per prompt")
  ap.add_argument("--turns", type=int, default=4)
  ap.add_argument("--turn-tokens", type=int, default=24)
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--page", type=int, default=16)
  ap.add_argument("--steps-per-sync", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3, help="alternating rounds per arm after the cold ones")
  ap.add_argument("--out", default=os.path.join(HERE, "out", "episodes.json"))
  ap.add_argument("--readme", action="store_true", help="rewrite the table in benchmarks/README.md")
  args = ap.parse_args()
  result = measure(args)
  report(args.out, result, table(result), args.readme, "episodes",
         "Multi-turn episodes: KV reuse across turns (benchmarks/episodes.py, issue 15)")


if __name__ == "__main__":
  main()
