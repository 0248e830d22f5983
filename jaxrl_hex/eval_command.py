"""jaxrl-hex eval: held-out accuracy of a run's checkpoint or of a Hugging Face model, scored the way the
training loop scores its evaluations.

  jaxrl-hex eval --workdir=runs/demo [--step=N | --step=best] [--samples=8]
  jaxrl-hex eval --model-dir=/models/Qwen2.5-Math-1.5B --config=configs/gsm8k_grpo.py --out=qwen.json

The records are the task's eval split (its first train.eval_size, those the run evaluated on) or
--prompts, a JSONL file of {"prompt", "answer"} lines, scored by the task's reward. Greedy accuracy is
their mean reward under greedy decoding, with the engine, batch and scorer of the run's own
evaluations, so a checkpoint scores the eval_accuracy its step logged in metrics.jsonl. --samples=k
adds k samples per prompt at rollout.temperature: mean@k, their mean reward, and pass@k, the mean over
prompts of the best of the k (for 0/1 rewards, the share of prompts some sample solves). The figures
and each record's completions and rewards go to a JSON file (WORKDIR/eval-STEP.json unless --out),
a short table to stdout. Any config field can be set with --config.SECTION.FIELD=VALUE.
"""
import json
import os
import time

import jax

from jaxrl_hex import arguments
from jaxrl_hex.checkpoint import Checkpointer, step_arg
from jaxrl_hex.commands import DEFAULT_CONFIG, config_overrides
from jaxrl_hex.config import apply_overrides, load_config_file, read_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.evaluation import greedy_completions, rewards, sampled_completions
from jaxrl_hex.generate import check_prompts, checkpoint_engine, prepare_devices, saved_step
from jaxrl_hex.models.hf import load_params
from jaxrl_hex.models.model_dir import resolve_model_dir
from jaxrl_hex.rollout.engine import Engine, Request, engine_options
from jaxrl_hex.runtime import build_runtime
from jaxrl_hex.tasks.scoring import RewardScorer

RECORD = '{"prompt": ..., "answer": ...}'


def _parser():
  ap = arguments.Parser("jaxrl-hex eval", __doc__.splitlines()[0])
  source = ap.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="a train or sft run (its config.json and checkpoints/)")
  source.add_argument(
      "--model-dir", help="a Hugging Face model directory, a .gguf file or a packaged model's name "
      "(SmolLM2-135M-Instruct), with --config's task, mesh and rollout")
  ap.add_argument("--config", default=None,
                  help=f"with --model-dir: the config file giving the task and mesh (default {DEFAULT_CONFIG})")
  ap.add_argument(
      "--step", type=step_arg, default=None,
      help="with --workdir: checkpoint step, or best (train.keep_best's best evaluation); default: the "
      "latest")
  ap.add_argument("--prompts", default=None, help=f"JSONL file, one {RECORD} per line (default: the task's eval split)")
  ap.add_argument(
      "--eval-size", type=int, default=None,
      help="score the first N records (default: train.eval_size as the run evaluated, sft.eval_size for "
      "an sft checkpoint; all of --prompts)")
  ap.add_argument("--samples", type=int, default=1, help="k > 1: also k samples per prompt (pass@k, mean@k)")
  ap.add_argument("--temperature", type=float, default=None, help="with --samples: overrides rollout.temperature")
  ap.add_argument("--seed", type=int, default=0, help="with --samples: the sampling seed")
  ap.add_argument("--out", default=None, help="JSON file to write (default: WORKDIR/eval-STEP.json)")
  return ap


def _check_args(args):
  """The flags on their own, before anything is read or built."""
  if args.samples < 1:
    raise UserError(f"--samples={args.samples} must be >= 1 (completions per prompt: 1 = greedy accuracy only, "
                    "k > 1 adds pass@k and mean@k)")
  if args.eval_size is not None and args.eval_size < 1:
    raise UserError(f"--eval-size={args.eval_size} must be >= 1 (the first N records are scored); drop it for the "
                    "run's train.eval_size")
  if args.temperature is not None and args.samples == 1:
    raise UserError(f"--temperature={args.temperature:g} sets how --samples=k samples; add e.g. --samples=8, or "
                    "drop it (greedy accuracy takes none)")
  if args.temperature is not None and args.temperature <= 0:
    raise UserError(f"--temperature={args.temperature:g} must be > 0 (sampling for pass@k; greedy accuracy is "
                    "always scored)")
  if args.model_dir and args.step is not None:
    raise UserError("--step picks a checkpoint of --workdir; --model-dir holds one set of weights: drop --step")
  if args.workdir and args.config is not None:
    raise UserError(f"--config={args.config}: --workdir is scored with the run's saved config.json; drop --config "
                    "and set the fields to change with --config.SECTION.FIELD=VALUE")
  if args.model_dir and args.out is None:
    raise UserError("--model-dir: there is no run directory to write the results in; name the JSON file with "
                    "--out=FILE")
  if args.out is not None:
    arguments.check_out_file(args.out, "eval.json")
  model_dir = resolve_model_dir(args.model_dir, "--model-dir") if args.model_dir else None
  if model_dir and not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise UserError(f"--model-dir: {args.model_dir} has no config.json; point it at a Hugging Face model directory "
                    "(config.json, tokenizer files, *.safetensors), a .gguf file or a packaged model's name")


def _read_records(path):
  """--prompts -> [(line number, record)]."""
  records = []
  for line, row in arguments.jsonl_rows(path, "--prompts", RECORD):
    missing = [k for k in ("prompt", "answer") if not isinstance(row, dict) or k not in row]
    if missing:
      raise UserError(f"--prompts: line {line} of {path} has no {' or '.join(map(repr, missing))}; each line is "
                      f"{RECORD}, the answer the task's reward checks")
    if not isinstance(row["prompt"], (str, list)):
      raise UserError(f"--prompts: line {line} of {path}: the prompt is a {type(row['prompt']).__name__}; make it "
                      "a string (or a chat, a list of messages)")
    records.append((line, row))
  return records


def _config(args, overrides):
  """-> (config, checkpointer, step, meta); the checkpoint's meta is read, none of its arrays."""
  if args.workdir:
    cfg = read_run_config(args.workdir)
    prepare_devices(cfg)
    checkpointer = Checkpointer(saved_step(args.workdir, args.step))
    step = checkpointer.resolve(args.step)
    meta = checkpointer.meta(step)
  else:
    cfg = load_config_file(DEFAULT_CONFIG if args.config is None else args.config)
    cfg.model_dir = args.model_dir
    checkpointer, step, meta = None, None, {}
  apply_overrides(cfg, overrides)
  if args.temperature is not None:
    cfg.rollout.temperature = args.temperature
  return cfg, checkpointer, step, meta


def run_eval(args, unparsed) -> dict:
  _check_args(args)
  cfg, checkpointer, step, meta = _config(args, config_overrides(unparsed))
  lines = _read_records(args.prompts) if args.prompts else None
  out = args.out or os.path.join(args.workdir, f"eval-{step}.json")
  prepare_devices(cfg)
  rt = build_runtime(cfg, check_prompts=lines is None)  # --prompts are measured below, naming their lines
  r, k = cfg.rollout, args.samples
  options = engine_options(r)
  # the run evaluated this many: the RL loop train.eval_size, a warm start or sft run sft.eval_size
  size = args.eval_size or (cfg.sft.eval_size if meta.get("phase") in ("sft", "warmstart") else cfg.train.eval_size)
  if lines is not None:
    check_prompts([(line, Request(row["prompt"], id=line)) for line, row in lines], args.prompts, rt, options["slots"])
    records = [row for _, row in lines][:size]
  else:
    records = list(rt.task.eval[:size])
  ways = rt.pool("rollout").batch_ways
  if k > options["slots"]:
    raise UserError(f"--samples={k}: a prompt's samples decode together and the engine has {options['slots']} "
                    f"decode slots (rollout.slots); pass --config.rollout.slots={-(-k // ways) * ways} or fewer")
  # the RL loop's evaluation engine (cluster/local.py) plus the sampling knobs, which greedy decoding ignores
  if checkpointer is not None:
    engine = checkpoint_engine(rt, checkpointer.directory, step, options)[0]
  else:  # the model's own weights: with model.lora the base, before any adapter is trained
    base = rt.policy.base()
    engine = Engine(base, rt.pool("rollout"), rt.tokenizer, r.max_new_tokens, r.temperature, r.top_k, r.top_p,
                    **options)
    engine.load_weights(0, load_params(resolve_model_dir(cfg.model_dir), base.cfg, engine.param_shardings))
  version = engine.version
  scorer = RewardScorer(rt.task, r.reward_timeout_s)
  t0 = time.perf_counter()
  try:
    greedy = greedy_completions(engine, records, len(records))  # one batch, as the RL loop evaluates
    greedy_rewards = rewards(scorer, records, greedy)
    if k > 1:
      samples = sampled_completions(engine, records, k, jax.random.key(args.seed), len(records))
      sample_rewards = rewards(scorer, [row for row in records for _ in range(k)],
                               [c for group in samples for c in group]).reshape(len(records), k)
  finally:
    scorer.close()
  result = {
      "source": args.workdir or args.model_dir,
      "step": step,
      "policy_version": version,
      "records": len(records),
      "records_from": args.prompts or f"task {rt.task.name!r} eval split",
      "greedy_accuracy": float(greedy_rewards.mean()),
      "samples": k
  }
  if k > 1:
    result.update({
        "temperature": r.temperature,
        f"mean@{k}": float(sample_rewards.mean()),
        f"pass@{k}": float(sample_rewards.max(axis=1).mean())
    })
  result.update(reward_errors=scorer.errors, seconds=round(time.perf_counter() - t0, 3), out=out)
  result["results"] = [
      dict({key: row[key] for key in ("id", "prompt", "answer") if key in row}, greedy=text, reward=float(reward),
           **({
               "samples": samples[i],
               "sample_rewards": sample_rewards[i].tolist()
           } if k > 1 else {})) for i, (row, text, reward) in enumerate(zip(records, greedy, greedy_rewards))
  ]
  with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1, default=str)
  os.replace(out + ".tmp", out)
  return result


def _table(result) -> str:
  k = result["samples"]
  where = f"checkpoint {result['step']} (policy version {result['policy_version']})" if result["step"] is not None \
      else "Hugging Face weights"
  lines = [
      f"eval of {result['source']}, {where}: {result['records']} records ({result['records_from']})",
      f"  greedy accuracy  {result['greedy_accuracy']:.4f}"
  ]
  if k > 1:
    lines += [
        f"  {f'mean@{k}':<16} {result[f'mean@{k}']:.4f}  (temperature {result['temperature']:g})",
        f"  {f'pass@{k}':<16} {result[f'pass@{k}']:.4f}"
    ]
  if result["reward_errors"]:
    lines.append(f"  reward errors    {result['reward_errors']} (each scored 0)")
  return "\n".join(lines + [f"wrote {result['out']}"])


def main(argv) -> int:
  return arguments.run(_parser(), lambda args, unparsed: print(_table(run_eval(args, unparsed))), argv, extras=True)
