"""The rollout engine's logprobs against the trainer's at equal weights, per compute dtype, on a
real model: what the logprob probe (sync/probe.py) compares, over many prompts, and the behaviour
weight the gap feeds.

For each compute dtype (the weights stay fp32):
- probe: the engine greedy-decodes chat prompts, as the probe does (Engine.generate, greedy, on the
  rollout pool) and the trainer re-scores the decoded tokens with Trainer.score's program
  (rl.layout.token_logprobs under the train pool's activation sharding). The gap per token, and
  per prompt its largest (the probe's statistic), against sync.probe_tolerance as the dtype sets
  it (probe.tolerance). The same tokens scored by an fp32 trainer are the reference each side's
  own error is read against.
- behaviour: sampled rollouts at a recipe's temperature. At version 0 the trainer's logprob is the
  proximal one and the engine's the behaviour one, so their difference per token (and summed over
  a sequence) is the log of decoupled PPO's behaviour weight, whose cap (algo.behav_weight_cap)
  masks tokens.

  python benchmarks/bf16_gap.py [--model_dir SmolLM2-135M-Instruct] [--prompts 32] [--max_new_tokens 96]
      [--readme]  ->  benchmarks/out/bf16_gap.json (and its table in benchmarks/README.md)
"""
import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from readme_section import report  # noqa: E402

from jaxrl_hex import meshes  # noqa: E402
from jaxrl_hex.models.hf import hf_model_config, load_params  # noqa: E402
from jaxrl_hex.models.model_dir import resolve_model_dir  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.models.sharding import traced_under  # noqa: E402
from jaxrl_hex.models.tokenizer import HFTokenizer  # noqa: E402
from jaxrl_hex.rl.batch import scoring_batch  # noqa: E402
from jaxrl_hex.rl.layout import token_logprobs  # noqa: E402
from jaxrl_hex.rollout.engine import Engine  # noqa: E402
from jaxrl_hex.sync.probe import tolerance_for  # noqa: E402

QUESTIONS = [
    "Name a color.", "Write a haiku about the sea.", "What is the capital of France?", "Say hello in Spanish.",
    "Give me a synonym for happy.", "Who wrote Hamlet?", "List three fruits.", "Translate 'cat' to French.",
    "What day comes after Monday?", "How many legs does a spider have?", "Spell 'banana' backwards.",
    "Is the sun a star?", "Tell me a fun fact.", "Why is the sky blue?", "Describe a cat in one sentence.",
    "What is photosynthesis?"
]


def prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
  """n chat prompts: the general questions, then "What is X + Y?" (the arithmetic tasks' shape)."""
  rng = np.random.RandomState(seed)
  sums = [f"What is {a} + {b}?" for a, b in rng.randint(0, 100, (n, 2))]
  return [tokenizer.prompt(q) for q in (QUESTIONS + sums)[:n]]


@dataclasses.dataclass
class Sides:
  """One rollout's completion tokens scored on each side: [N, C] arrays, mask where a token is."""
  engine: np.ndarray
  trainer: np.ndarray
  reference: np.ndarray  # an fp32 trainer's
  mask: np.ndarray


def stats(x) -> dict:
  x = np.asarray(x, np.float64)
  return dict(max=float(x.max()), p99=float(np.percentile(x, 99)), p999=float(np.percentile(x, 99.9)),
              mean=float(x.mean()))


class Bench:
  """One model on the train and rollout pools of a mesh file, per compute dtype."""

  def __init__(self, model_dir: str, mesh_file: str, max_new_tokens: int):
    self.model_dir, self.max_new_tokens = model_dir, max_new_tokens
    mesh = meshes.load_mesh_file(mesh_file)
    if mesh.platform == "cpu":
      meshes.prepare_cpu_devices(mesh.num_devices)
    self.pools = meshes.build_pools(mesh)
    self.tokenizer = HFTokenizer(model_dir, eos_token="<|im_end|>")
    reference = self.policy("float32")
    self.params = load_params(model_dir, reference.cfg, self.pools["train"].shardings_for(*self._abstract(reference)))
    self.score_reference = self._scorer(reference)

  def policy(self, dtype: str) -> Policy:
    return Policy.build(hf_model_config(self.model_dir, dtype=dtype, param_dtype="float32", scan_layers=True))

  @staticmethod
  def _abstract(policy):
    return policy.logical_axes(), policy.shapes()

  def _scorer(self, policy):
    """Trainer.score's program: token logprobs of a scoring batch at `temperature`."""
    pool = self.pools["train"]
    fn = lambda params, batch, temperature: token_logprobs(policy, params, batch, temperature)[0]
    return jax.jit(traced_under(pool.activation_sharding, fn), static_argnums=2)

  def run(self, dtype: str, texts: list[str], group_size: int, temperature: float, greedy: bool) -> Sides:
    policy = self.policy(dtype)
    engine = Engine(policy, self.pools["rollout"], self.tokenizer, self.max_new_tokens, temperature,
                    slots=len(texts) * group_size, max_prompt_len=64)
    engine.load_weights(0, jax.device_put(self.params, engine.param_shardings))
    rollout = engine.generate(texts, group_size, jax.random.key(0), greedy=greedy)
    batch = scoring_batch(rollout)
    at = 1.0 if greedy else temperature  # greedy decoding records temperature-1 logprobs
    trainer = np.asarray(self._scorer(policy)(self.params, batch, at))
    reference = np.asarray(self.score_reference(self.params, batch, at))
    return Sides(rollout.behaviour_logprobs, trainer, reference, rollout.completion_mask)


def probe_figures(sides: Sides, dtype: str) -> dict:
  gap = np.abs(sides.engine - sides.trainer)
  per_probe = np.array([g[m].max() for g, m in zip(gap, sides.mask) if m.any()])
  allowed = tolerance_for(0.02, dtype)
  return dict(tokens=int(sides.mask.sum()), gap=stats(gap[sides.mask]), probe_max_median=float(np.median(per_probe)),
              probe_max_max=float(per_probe.max()), tolerance=allowed, probes_over=int(
                  (per_probe
                   > allowed).sum()), engine_vs_fp32=stats(np.abs(sides.engine - sides.reference)[sides.mask]),
              trainer_vs_fp32=stats(np.abs(sides.trainer - sides.reference)[sides.mask]))


def behaviour_figures(sides: Sides, cap: float) -> dict:
  """log(pi_prox / pi_behav) at version 0, per token and summed per sequence."""
  log_ratio = np.where(sides.mask, sides.trainer - sides.engine, 0.0)
  token = log_ratio[sides.mask]
  sequence = log_ratio.sum(1)[sides.mask.any(1)]
  return dict(tokens=int(sides.mask.sum()), token_log_ratio_mean=float(token.mean()),
              token_log_ratio_abs_mean=float(np.abs(token).mean()), token_log_ratio_abs_max=float(np.abs(token).max()),
              weight_min=float(np.exp(token.min())), weight_max=float(np.exp(token.max())),
              sequence_log_ratio_abs_max=float(np.abs(sequence).max()), tokens_over_cap=int((np.exp(token)
                                                                                             > cap).sum()))


def table(out: dict) -> str:
  """The figures as markdown: per dtype the probe's gaps and each side's error, then the behaviour weight."""
  lines = [
      f"{out['model_dir']}, {out['prompts']} greedy chat prompts x up to {out['max_new_tokens']} tokens "
      f"(the probe's program); behaviour: sampled at temperature {out['temperature']}, version 0. Nats.", "",
      "| compute | tokens | gap max | gap p99.9 | gap p99 | gap mean | probe max (median / max) | tolerance "
      "| engine vs fp32 max / mean | trainer vs fp32 max / mean | behaviour log-ratio mean abs / max abs "
      "| sequence sum max abs |", "|---" * 12 + "|"
  ]
  for dtype, d in out["dtypes"].items():
    p, b = d["probe"], d.get("behaviour")
    g, e, t = p["gap"], p["engine_vs_fp32"], p["trainer_vs_fp32"]
    weight = "-" if b is None else f"{b['token_log_ratio_abs_mean']:.3g} / {b['token_log_ratio_abs_max']:.3g}"
    sequence = "-" if b is None else f"{b['sequence_log_ratio_abs_max']:.3g}"
    lines.append(f"| {dtype} | {p['tokens']} | {g['max']:.3g} | {g['p999']:.3g} | {g['p99']:.3g} | {g['mean']:.3g} "
                 f"| {p['probe_max_median']:.3g} / {p['probe_max_max']:.3g} | {p['tolerance']:g} "
                 f"| {e['max']:.3g} / {e['mean']:.3g} | {t['max']:.3g} / {t['mean']:.3g} | {weight} | {sequence} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model_dir", default="SmolLM2-135M-Instruct")
  ap.add_argument("--mesh", default=os.path.join(os.path.dirname(HERE), "meshes", "cpu-1-1.yaml"))
  ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--max_new_tokens", type=int, default=96)
  ap.add_argument("--sampled_prompts", type=int, default=8, help="prompts of the behaviour-weight rollouts (0: none)")
  ap.add_argument("--group_size", type=int, default=4)
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--behav_weight_cap", type=float, default=5.0)
  ap.add_argument("--out", default=os.path.join(HERE, "out", "bf16_gap.json"))
  ap.add_argument("--readme", action="store_true", help="rewrite the table in benchmarks/README.md")
  args = ap.parse_args()
  bench = Bench(resolve_model_dir(args.model_dir), args.mesh, args.max_new_tokens)
  texts = prompts(bench.tokenizer, args.prompts)
  out = dict(model_dir=args.model_dir, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
             temperature=args.temperature, dtypes={})
  for dtype in args.dtypes:
    probe = probe_figures(bench.run(dtype, texts, 1, 1.0, greedy=True), dtype)
    out["dtypes"][dtype] = dict(probe=probe)
    if args.sampled_prompts:
      sampled = bench.run(dtype, texts[:args.sampled_prompts], args.group_size, args.temperature, greedy=False)
      out["dtypes"][dtype]["behaviour"] = behaviour_figures(sampled, args.behav_weight_cap)
    print(json.dumps({dtype: out["dtypes"][dtype]}, indent=1), flush=True)
  report(args.out, out, table(out), args.readme, "bf16-gap", "Engine against trainer logprobs per compute dtype "
         "(benchmarks/bf16_gap.py, issue 53)")


if __name__ == "__main__":
  main()
