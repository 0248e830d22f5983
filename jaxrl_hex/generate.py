"""jaxrl-hex generate: sample completions from a run's checkpoint for a JSONL file of prompts.

  jaxrl-hex generate --workdir=runs/demo --prompts=prompts.jsonl --out=results.jsonl --samples=4

Each prompt line is {"prompt": str} with optional "id", "n" (samples), "max_tokens", "stop"
(strings). Each result line is one sample: id, sample index, completion text, finish_reason
(eos | stop | length), truncated, tokens, logprobs and the policy version. The throughput
summary (one JSON object) goes to stdout.

A run of an environment (tasks/environment.py) plays episodes instead:

  jaxrl-hex generate --workdir=runs/guess --episodes=eval --out=transcripts.jsonl --greedy

--episodes names the task's split (eval | train) or a JSONL file of records for Env.reset; each
result line is one episode: the record, sample index, reward, turns, tool calls and errors, its
fault if it ended on one, and its transcript ([{"role": "env" | "model" | "tool", "text"}]).
"""
import json
import os
import sys
import time

import jax

from jaxrl_hex import arguments
from jaxrl_hex.base_weights import restore_run
from jaxrl_hex.checkpoint import BEST_FILE, Checkpointer, step_arg
from jaxrl_hex.config import FIELD_CHECKS, check_field, read_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.evaluation import greedy_episodes
from jaxrl_hex.meshes import prepare_cpu_devices
from jaxrl_hex.metrics import Progress
from jaxrl_hex.rollout.engine import Engine, Request, engine_options
from jaxrl_hex.rollout.streams import make_stream
from jaxrl_hex.runtime import build_runtime, load_mesh
from jaxrl_hex.sync.adapters import AdapterWeights
from jaxrl_hex.tasks import is_episodic, prompt_length

FLAGS = {  # flag -> config.rollout field
    "max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
    "slots": int, "max_prompt_len": int, "steps_per_sync": int, "memory_budget_gb": float,
}


def _parser():
  ap = arguments.Parser("jaxrl-hex generate", __doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True, help="a train or sft run (its config.json and checkpoints/)")
  ap.add_argument("--prompts", help="JSONL file, one {\"prompt\": ...} per line")
  ap.add_argument(
      "--episodes", help="a run of an environment: play episodes of its split (eval | train) or of a "
      "JSONL file of records, and write their transcripts")
  ap.add_argument("--out", required=True, help="JSONL file to write, one line per sample")
  ap.add_argument("--samples", type=int, default=1, help="samples per prompt unless a line sets \"n\"")
  ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
  ap.add_argument("--greedy", action="store_true")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--step", type=step_arg, default=None,
                  help="checkpoint step, or best (train.keep_best's best evaluation); default: the latest")
  for name, kind in FLAGS.items():
    ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"overrides rollout.{name}")
  return ap


def prepare_devices(cfg):
  """The simulated CPU devices the run's mesh file asks for, before anything starts JAX (reading a
  run's checkpoints does: Orbax asks for the default backend)."""
  mesh_file = load_mesh(cfg)
  if mesh_file.platform == "cpu" and mesh_file.num_devices:
    prepare_cpu_devices(mesh_file.num_devices)


def saved_step(workdir: str, step, field: str = "--workdir") -> str:
  """The checkpoints/ of a run, after checking it holds a checkpoint (at `step`, a number or "best",
  when given); `field` names the flag of the workdir in errors. Reads no weights."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  # Checkpointer creates a missing directory: a run without one has saved nothing
  checkpointer = Checkpointer(ckpt_dir) if os.path.isdir(ckpt_dir) else None
  steps = checkpointer.steps() if checkpointer else []
  if not steps:
    raise UserError(f"{field}: {workdir} holds no checkpoint yet ({ckpt_dir} is empty or missing); point {field} "
                    "at a train or sft run that saved one (sft saves at its end, train every train.checkpoint_every "
                    "steps)")
  if step == "best" and checkpointer.best is None:
    raise UserError(f"--step=best: {workdir} has no best checkpoint (no {ckpt_dir}/{BEST_FILE}): it trained "
                    "without --config.train.keep_best=True or has not evaluated since; pass one of its steps "
                    f"{steps}, or drop --step for the latest ({steps[-1]})")
  if step not in (None, "best") and step not in steps:
    raise UserError(f"--step={step}: {workdir} has no checkpoint at step {step}; it has steps {steps}: pass one of "
                    f"them, or drop --step for the latest ({steps[-1]})")
  return ckpt_dir


def checkpoint_engine(rt, ckpt_dir: str, step, options: dict) -> tuple:
  """An engine with the run's rollout settings, loaded with its checkpoint `step` (None: the newest
  that restores) -> (engine, the checkpoint's meta). A LoRA run's checkpoint is its adapters on the
  base its record names, served as its own evaluations served them (rollout.lora_serving), so
  greedy decoding here is the run's."""
  r, policy = rt.cfg.rollout, rt.policy
  shardings = rt.shardings("rollout")
  serving = AdapterWeights(policy, shardings, r.lora_serving) if policy.lora else None
  engine = Engine(serving.engine_policy if serving else policy, rt.pool("rollout"), rt.tokenizer, r.max_new_tokens,
                  r.temperature, r.top_k, r.top_p, **options)
  params, meta = restore_run(policy, ckpt_dir, step, shardings, "--workdir")
  version = int(meta.get("policy_version", meta.get("step", 0)))  # an sft checkpoint: its step
  if serving:
    adapters, base = policy.split(params)
    serving.set_base(None, base)
    params = serving.assemble(version, adapters)
  engine.load_weights(version, params)
  return engine, meta


def _check_args(args):
  """The flags on their own, before anything is read or built."""
  if (args.prompts is None) == (args.episodes is None):
    raise UserError("generate: pass --prompts=FILE.jsonl (completions) or --episodes=eval|train|FILE.jsonl (a run of "
                    "an environment: episodes), one of the two")
  if args.samples < 1:
    raise UserError(f"--samples={args.samples} must be >= 1 (samples per prompt unless a line sets \"n\")")
  for name in FLAGS:
    value = getattr(args, name)
    if value is not None and f"rollout.{name}" in FIELD_CHECKS:
      check_field(f"rollout.{name}", value, "--" + name.replace("_", "-"))
  arguments.check_out_file(args.out, "samples.jsonl")


def _read_prompts(path, samples):
  """-> [(line number, Request)]."""
  requests = []
  for line, row in arguments.jsonl_rows(path, "--prompts", '{"prompt": ...}'):
    try:
      if not isinstance(row["prompt"], (str, list)):
        raise TypeError(f"prompt is a {type(row['prompt']).__name__}")
      request = Request(row["prompt"], n=int(row.get("n", samples)), max_tokens=row.get("max_tokens"),
                        stop=tuple(row.get("stop", ())), id=row.get("id", line - 1))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise UserError(f"--prompts: line {line} of {path} is not {{\"prompt\": str, ...}} JSON ({e})") from None
    if request.n < 1:
      raise UserError(f"--prompts: line {line} of {path} asks for n={request.n} samples; make it >= 1 or drop "
                      "\"n\" (then --samples)")
    requests.append((line, request))
  return requests


def check_prompts(requests, path, rt, slots: int):
  """Every prompt fits the model and the engine, before weights load or anything compiles (the engine
  finds out only as it queues them)."""
  r, m = rt.cfg.rollout, rt.cfg.model
  lengths = []
  for line, request in requests:
    try:
      n = prompt_length(rt.tokenizer, request.prompt)
    except UserError as e:
      raise UserError(f"--prompts: line {line} of {path}: {e}") from None
    if n > m.max_seq_len:
      raise UserError(f"--prompts: line {line} of {path} is {n} tokens (BOS included), longer than the model's "
                      f"max_seq_len={m.max_seq_len} (model.max_seq_len, the positions it was built for); shorten it")
    if request.n > slots:
      ways = rt.mesh_file.pools["rollout"].batch_ways
      raise UserError(f"--prompts: line {line} of {path} asks for {request.n} samples but the engine has {slots} "
                      f"decode slots (rollout.slots); pass --slots={-(-request.n // ways) * ways} or ask for fewer")
    lengths.append((n, line))
  over = [(n, line) for n, line in lengths if n > r.max_prompt_len]
  if over:
    longest, line = max(over)
    raise UserError(f"--prompts: {len(over)} of {len(lengths)} prompts in {path} are longer than "
                    f"rollout.max_prompt_len={r.max_prompt_len} (line {line}: {longest} tokens, BOS included); "
                    f"pass --max-prompt-len={longest} (the KV cache grows with it) or shorten them")


def generate(args) -> dict:
  _check_args(args)
  cfg = read_run_config(args.workdir)
  prepare_devices(cfg)
  ckpt_dir = saved_step(args.workdir, args.step)
  for name in FLAGS:
    if getattr(args, name) is not None:
      cfg.rollout[name] = getattr(args, name)
  cfg.rollout.stop = list(cfg.rollout.stop) + args.stop
  lines = _read_prompts(args.prompts, args.samples) if args.prompts else []
  requests = [request for _, request in lines]
  rt = build_runtime(cfg, check_prompts=False)  # the task's prompts are not this command's
  r = cfg.rollout
  options = engine_options(r)
  if args.episodes is not None:
    return _episodes(args, rt, ckpt_dir, options)
  check_prompts(lines, args.prompts, rt, options["slots"])
  engine, _ = checkpoint_engine(rt, ckpt_dir, args.step, options)
  engine.rng = jax.random.key(args.seed)
  engine.greedy = args.greedy
  prompts = {r.id: r.prompt for r in requests}
  total = sum(r.n for r in requests)
  progress = Progress("generate", total, max(total // 20, 1), stream=sys.stderr,
                      unit="sample")  # stdout: the summary JSON
  t0 = time.perf_counter()
  engine.submit(requests)
  n_samples = new_tokens = 0
  with open(args.out, "w") as out:
    while engine.pending:
      progress.update(n_samples, {"rollout_tokens_per_s": new_tokens / max(time.perf_counter() - t0, 1e-9)})
      for s in engine.poll():
        n_samples += 1
        new_tokens += len(s.tokens)
        out.write(
            json.dumps({
                "id": s.request_id,
                "sample": s.index,
                "prompt": prompts[s.request_id],
                "completion": s.text,
                "finish_reason": s.finish_reason,
                "truncated": s.truncated,
                "tokens": s.tokens.tolist(),
                "logprobs": [round(x, 6) for x in s.logprobs.tolist()],
                "version": int(s.versions[0]) if len(s.versions) else engine.version
            }) + "\n")
  seconds = time.perf_counter() - t0
  progress.update(n_samples, {"rollout_tokens_per_s": new_tokens / max(seconds, 1e-9)})
  progress.close()
  run_s = max(seconds - engine.compile_seconds, 1e-9)
  return {
      "requests": len(requests),
      "samples": n_samples,
      "new_tokens": new_tokens,
      "seconds": round(seconds, 3),
      "compile_count": engine.compile_count,
      "compile_s": round(engine.compile_seconds, 3),
      "new_tokens_per_s": round(new_tokens / run_s, 1),
      "decode_steps": engine.decode_steps,
      "slot_utilization": round(new_tokens / max(engine.decode_steps * engine.num_slots, 1), 3),
      "slots": engine.num_slots,
      "policy_version": engine.version,
      **engine.memory, "out": args.out
  }


def _episode_records(args, task) -> list:
  if args.episodes in ("eval", "train"):
    return list(getattr(task, args.episodes))
  return [row for _, row in arguments.jsonl_rows(args.episodes, "--episodes", "{...a record for Env.reset...}")]


def _episodes(args, rt, ckpt_dir, options) -> dict:
  """Episodes of the run's environment -> one transcript line each in --out; the summary."""
  if not is_episodic(rt.task):
    raise UserError(f"--episodes: the run's task {rt.cfg.task!r} is not an environment or agent (it returns a Task, "
                    "not an EnvTask or AgentTask); pass --prompts=FILE.jsonl for completions")
  records = _episode_records(args, rt.task)
  engine, _ = checkpoint_engine(rt, ckpt_dir, args.step, options)
  t0 = time.perf_counter()
  rng = None if args.greedy else jax.random.key(args.seed)
  stream = make_stream(engine, rt.task, rt.cfg.rollout.turn_tokens)
  try:
    rewards, episodes = greedy_episodes(stream, records, args.samples, rng)
  finally:
    stream.close()
  with open(args.out, "w") as out:
    for ep in episodes:
      out.write(
          json.dumps({
              "record": records[ep.row // args.samples],
              "sample": ep.row % args.samples,
              "reward": ep.reward,
              "turns": ep.turns,
              "tool_calls": ep.tool_calls,
              "tool_errors": ep.tool_errors,
              "fault": ep.fault,
              "truncated": ep.truncated,
              "transcript": ep.transcript,
          }) + "\n")
  return {
      "episodes": len(episodes),
      "reward_mean": round(float(rewards.mean()), 4),
      "faults": sum(ep.fault is not None for ep in episodes),
      "seconds": round(time.perf_counter() - t0, 3),
      "policy_version": engine.version,
      "out": args.out
  }


def main(argv) -> int:
  return arguments.run(_parser(), lambda args: print(json.dumps(generate(args))), argv)
