"""One GRPO job three ways, back to back on this machine: `jaxrl-hex train`, TRL's GRPOTrainer (PyTorch on
CPU, transformers' generate, fp32) and Tunix's GRPOLearner (its Llama loader, in its own venv:
bash benchmarks/setup_tunix.sh).

The job is a run config (--config, default the small-instruct recipe configs/smollm2_grpo.py, with
--set KEY=VALUE on top). TRL and Tunix get what it resolves to: the model directory (a GGUF or a
packaged model as the Hugging Face directory it is converted to), the task's prompts as the engine's
token ids (BOS + the chat-template text, each side checked to tokenize them to the same ids), each
step's prompts in the order our prompt stream draws them, the task's reward, samples per prompt,
completion length, temperature, the clip range, token-mean loss, no KL, AdamW (lr, warmup, cosine
to end_lr_ratio, betas, weight decay, grad clip) with one optimizer step per batch, and the steps.
Each side reports greedy held-out accuracy on the same questions (at step 0, every --eval-every
steps and at the end; its own greedy decoder, the same max new tokens), seconds per RL step
(median after the first; an evaluation's time is not in a step), generation and training seconds
and tokens/s, and its child process's peak RSS (ru_maxrss from os.wait4).

  python benchmarks/vs_trl_tunix.py [--steps 30] [--eval-size 96] [--eval-every 10] [--sides ours,trl,tunix]
      [--config configs/X.py] [--set rollout.group_size=8 ...] [--json PATH] [--readme]

Token counts: rollout tokens are generated completion tokens (EOS included); train tokens are the
step's prompt and completion tokens summed over its samples, without padding, whatever a side
computes on them (ours runs a group's shared prompt once when algo.share_prompts is on).
"""
import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

OUT = os.path.join(HERE, "out", "vs_trl_tunix")
RECIPE = os.path.join(ROOT, "configs", "smollm2_grpo.py")  # the small-instruct recipe
TUNIX_PY = os.path.join(HERE, ".venv-tunix", "bin", "python")
GIB = 2**30
TRL_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
TUNIX_LOSS = {"token-mean": "token-mean", "seq-mean-token-mean": "sequence-mean-token-mean"}


class BenchError(Exception):
  """A job this benchmark cannot run the same way on every side."""


@dataclasses.dataclass
class Prompt:
  text: str  # the task's prompt text (the engine puts BOS before its tokens)
  ids: list  # BOS + the text's tokens, as the engine holds them
  answer: str


@dataclasses.dataclass
class Job:
  """The resolved run: everything each side needs to run the same job."""
  config: str
  overrides: list  # [key, value] pairs on top of config, as --config.KEY=VALUE
  model_dir: str
  prompts_per_step: int
  group_size: int
  max_new_tokens: int
  temperature: float
  top_p: float
  top_k: int
  lr: float
  warmup_steps: int
  end_lr_ratio: float
  b1: float
  b2: float
  weight_decay: float
  grad_clip: float
  clip_eps_low: float
  clip_eps_high: float
  loss_agg: str
  steps: int
  eval_every: int
  seed: int
  bos_id: int
  eos_ids: list
  pad_id: int
  train: list  # [Prompt], steps x prompts_per_step in the order the prompt stream draws them
  train_index: list  # their record indices in the task's train split
  eval: list  # [Prompt], the held-out records evaluated

  @classmethod
  def load(cls, path: str) -> "Job":
    with open(path) as f:
      raw = json.load(f)
    raw["train"] = [Prompt(**p) for p in raw["train"]]
    raw["eval"] = [Prompt(**p) for p in raw["eval"]]
    return cls(**raw)

  def save(self, path: str):
    with open(path, "w") as f:
      json.dump(dataclasses.asdict(self), f)

  def step_prompts(self, step: int) -> list:
    """The prompts of RL step `step` (0-based)."""
    return self.train[step * self.prompts_per_step:(step + 1) * self.prompts_per_step]

  def eval_steps(self) -> list:
    """The steps after which each side evaluates: 0, every eval_every, the last."""
    return sorted({0, self.steps, *range(self.eval_every, self.steps, self.eval_every)})


@dataclasses.dataclass
class StepTime:
  step: int  # 1-based
  seconds: float  # the whole RL step (generation, reward, training, weight sync), no evaluation
  gen_seconds: float
  gen_tokens: int
  train_seconds: float
  train_tokens: int


@dataclasses.dataclass
class SideResult:
  name: str
  error: str = ""  # why the side did not run the job ("" = it did)
  steps: list = dataclasses.field(default_factory=list)  # [StepTime]
  curve: list = dataclasses.field(default_factory=list)  # [[step, held-out greedy accuracy]]
  peak_rss_gib: float = 0.0
  wall_seconds: float = 0.0  # the child process, start to exit (loading, compiling and evaluations included)
  settings: dict = dataclasses.field(default_factory=dict)  # what the side ran with, beyond the Job

  @classmethod
  def from_dict(cls, d: dict) -> "SideResult":
    return cls(**dict(d, steps=[StepTime(**s) for s in d.get("steps", [])]))

  def summary(self) -> dict:
    """Medians over the steps after the first (which compiles)."""
    steady = [s for s in self.steps if s.step > 1]
    med = lambda values: statistics.median(values) if values else None
    return {
        "step_s": med([s.seconds for s in steady]),
        "first_step_s": next((s.seconds for s in self.steps if s.step == 1), None),
        "gen_s": med([s.gen_seconds for s in steady]),
        "train_s": med([s.train_seconds for s in steady]),
        "rollout_tokens_per_s": med([s.gen_tokens / s.gen_seconds for s in steady if s.gen_seconds > 0]),
        "train_tokens_per_s": med([s.train_tokens / s.train_seconds for s in steady if s.train_seconds > 0]),
        "accuracy_start": self.curve[0][1] if self.curve else None,
        "accuracy_end": self.curve[-1][1] if self.curve else None,
        "peak_rss_gib": self.peak_rss_gib,
        "wall_s": self.wall_seconds,
    }


# ---- the job ------------------------------------------------------------------------------------


def resolved_config(config: str, overrides: list):
  from jaxrl_hex.config import apply_overrides, load_config_file
  cfg = load_config_file(config)
  apply_overrides(cfg, [tuple(kv) for kv in overrides])
  return cfg


def load_job_task(config: str, overrides: list):
  """The task the run loads (its records, reward and tokenizer), as jaxrl-hex train builds it."""
  from jaxrl_hex.tasks import Task, load_task
  cfg = resolved_config(config, overrides)
  task = load_task(cfg.task, cfg)
  if not isinstance(task, Task):
    raise BenchError(f"task {cfg.task!r} is episodic; TRL and Tunix take one completion per prompt")
  return cfg, task


def check_comparable(cfg):
  """The run's algorithm is one TRL's and Tunix's GRPO can run as it is."""
  a = cfg.algo
  wrong = {
      "algo.advantage": (a.advantage, "grpo"),
      "algo.loss": (a.loss, "ppo"),
      "algo.kl_coef": (a.kl_coef, 0.0),
      "algo.entropy_coef": (a.entropy_coef, 0.0),
      "algo.minibatches": (a.minibatches, 1),
      "algo.dynamic_sampling": (a.dynamic_sampling, False),
      "algo.overlong_buffer": (a.overlong_buffer, 0),
      "model.lora.rank": (cfg.model.get("lora", {}).get("rank", 0), 0),
  }
  for field, (value, need) in wrong.items():
    if value != need:
      raise BenchError(f"{field}={value!r}: the comparison runs GRPO as TRL and Tunix do ({field}={need!r})")
  if a.loss_agg not in TRL_LOSS:
    raise BenchError(f"algo.loss_agg={a.loss_agg!r}: TRL has {sorted(TRL_LOSS)}")


def prompt_order(records, batch_size: int, seed: int, steps: int) -> list:
  """The record indices of each step's prompts, as the run's prompt stream draws them."""
  from jaxrl_hex.data.prompts import PromptStream
  stream = PromptStream(records, batch_size, seed=seed)
  return [[r["index"] for r in stream.next()[0]] for _ in range(steps)]


def resolve_job(config: str, overrides: list, steps: int, eval_every: int, eval_size: int) -> Job:
  from jaxrl_hex.models.model_dir import resolve_model_dir
  overrides = overrides + [["train.steps", str(steps)], ["train.eval_every", str(eval_every)],
                           ["train.eval_size", str(eval_size)]]
  cfg, task = load_job_task(config, overrides)
  check_comparable(cfg)
  tok, ro, o, a = task.tokenizer, cfg.rollout, cfg.optim, cfg.algo
  prompt = lambda r: Prompt(r["prompt"], [tok.bos_id] + tok.encode(r["prompt"]), str(r["answer"]))
  order = [i for batch in prompt_order(task.train, ro.prompts_per_step, cfg.seed, steps) for i in batch]
  warmup = min(o.warmup_steps, max(steps - 1, 1))  # as make_optimizer caps it
  train, held_out = [prompt(task.train[i]) for i in order], [prompt(r) for r in task.eval[:eval_size]]
  return Job(config=config, overrides=overrides, model_dir=resolve_model_dir(cfg.model_dir),
             prompts_per_step=ro.prompts_per_step, group_size=ro.group_size, max_new_tokens=ro.max_new_tokens,
             temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, lr=o.lr, warmup_steps=warmup,
             end_lr_ratio=o.end_lr_ratio, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
             clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, loss_agg=a.loss_agg, steps=steps,
             eval_every=eval_every, seed=cfg.seed, bos_id=tok.bos_id, eos_ids=list(ro.eos_ids) or [tok.eos_id],
             pad_id=tok.pad_id, train=train, train_index=order, eval=held_out)


def task_reward(job: Job):
  """The task's reward(prompt, completion, answer) -> float, built as the run builds it."""
  return load_job_task(job.config, job.overrides)[1].reward


# ---- child processes ----------------------------------------------------------------------------


def run_logged(cmd: list, log: str) -> tuple:
  """cmd to its end, its output in log -> (exit status, peak RSS in GiB of the child and what it
  waited for, seconds)."""
  print(" ".join(cmd), f"(log {log})", flush=True)
  with open(log, "w") as f:
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
  return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024 / GIB, time.time() - t0


def failure(rc: int, rss: float, log: str) -> str:
  """Why a side's process ended without its result, in one line."""
  if rc < 0:
    return (f"killed by {signal.Signals(-rc).name} at {rss:.1f} GiB peak RSS"
            f"{' (out of memory?)' if rc == -signal.SIGKILL else ''}; its output: {log}")
  try:
    with open(log) as f:
      last = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()][-1:]
  except OSError:
    last = []
  return f"exited with {rc}: {last[0] if last else '(no output)'}; its output: {log}"


# ---- ours ---------------------------------------------------------------------------------------


def train_tokens(job: Job, step: int, completion_tokens: int) -> int:
  return sum(len(p.ids) for p in job.step_prompts(step)) * job.group_size + completion_tokens


def run_ours(job: Job, workdir: str) -> SideResult:
  import shutil
  shutil.rmtree(workdir, ignore_errors=True)
  exe = os.path.join(os.path.dirname(sys.executable), "jaxrl-hex")
  cmd = [exe, "train", f"--config={job.config}", f"--workdir={workdir}"]
  cmd += [f"--config.{k}={v}" for k, v in job.overrides]
  rc, rss, wall = run_logged(cmd, workdir + ".log")
  if rc != 0:
    return SideResult("ours", error=failure(rc, rss, workdir + ".log"), peak_rss_gib=rss, wall_seconds=wall)
  res = ours_result(job, workdir)
  res.peak_rss_gib, res.wall_seconds = rss, wall
  with open(workdir + ".log") as f:  # the settings a run picks for its model and platform
    res.settings["chosen"] = [line.strip() for line in f if "chosen for this model" in line]
  return res


def ours_result(job: Job, workdir: str) -> SideResult:
  """Our side's figures from its run's metrics.jsonl and spans.jsonl. A row's wall time holds its
  step's evaluation and checkpoint, so the steps that evaluated are left out of the step times."""
  res = SideResult("ours")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if r.get("phase") == "train"]
  with open(os.path.join(workdir, "spans.jsonl")) as f:
    gen = {s["batch"]: s["end"] - s["start"] for s in map(json.loads, f) if s["kind"] == "generate"}
  res.curve = [[r["step"], r["eval_accuracy"]] for r in rows if r.get("eval_accuracy") is not None]
  evaluated = {step for step, _ in res.curve}
  steps = {r["step"]: r for r in rows}
  for k in range(1, job.steps + 1):
    r = steps[k]
    if sorted(r["prompt_ids"]) != sorted(job.train_index[(k - 1) * job.prompts_per_step:k * job.prompts_per_step]):
      raise BenchError(f"ours' step {k} trained prompts {r['prompt_ids']}, not the stream order this benchmark "
                       "gave TRL and Tunix")
    if k in evaluated:
      continue
    g = gen[r["batch"]]
    completion = round(r["rollout_tokens_per_s"] * g)
    res.steps.append(
        StepTime(k, r["wall_s"] - steps[k - 1]["wall_s"], g, completion, r["train_seconds"],
                 train_tokens(job, k - 1, completion)))
  with open(os.path.join(workdir, "config.json")) as f:
    cfg = json.load(f)
  res.settings = {
      "max_staleness": cfg["train"]["max_staleness"],
      "share_prompts": cfg["algo"]["share_prompts"],
      "mesh_file": cfg["mesh_file"]
  }
  return res


# ---- TRL ----------------------------------------------------------------------------------------


def trl_text(tokenizer, job: Job, prompt: Prompt) -> str:
  """The text TRL tokenizes (tokenizer(text), special tokens on) into the engine's ids: the BOS
  token's text first where the tokenizer does not put it there itself."""
  adds_bos = tokenizer("")["input_ids"][:1] == [job.bos_id]
  return prompt.text if adds_bos else tokenizer.convert_ids_to_tokens(job.bos_id) + prompt.text


def greedy_accuracy_torch(model, tokenizer, job: Job, reward, batch: int = 32) -> float:
  """transformers' greedy generate on the held-out prompts (left-padded) -> mean reward."""
  import torch
  was_training, scores = model.training, []
  model.eval()
  for i in range(0, len(job.eval), batch):
    chunk = job.eval[i:i + batch]
    width = max(len(p.ids) for p in chunk)
    ids = torch.tensor([[job.pad_id] * (width - len(p.ids)) + p.ids for p in chunk])
    mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in chunk])
    with torch.no_grad():
      out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=job.max_new_tokens,
                           eos_token_id=job.eos_ids, pad_token_id=job.pad_id, top_p=None, top_k=None, temperature=None)
    for p, row in zip(chunk, out[:, width:].tolist()):
      ends = [j for j, t in enumerate(row) if t in job.eos_ids]
      text = tokenizer.decode(row[:ends[0]] if ends else row, skip_special_tokens=True)
      scores.append(float(reward(p.text, text, p.answer)))
  model.train(was_training)
  return sum(scores) / len(scores)


def trl_side(job: Job, result_path: str):
  """TRL's GRPOTrainer on the job, in this (child) process; writes a SideResult as JSON."""
  import datasets
  import torch
  import transformers
  import trl

  torch.manual_seed(job.seed)
  tokenizer = transformers.AutoTokenizer.from_pretrained(job.model_dir)
  for p in job.train + job.eval:
    got = tokenizer(trl_text(tokenizer, job, p))["input_ids"]
    if got != p.ids:
      raise BenchError(f"TRL tokenizes {p.text!r} to {got}, the engine to {p.ids}")
  model = transformers.AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=torch.float32)
  reward = task_reward(job)

  def task_reward_fn(prompts, completions, task_prompt, answer, **_):
    return [float(reward(p, c, a)) for p, c, a in zip(task_prompt, completions, answer)]

  data = datasets.Dataset.from_list([{
      "prompt": trl_text(tokenizer, job, p),
      "task_prompt": p.text,
      "answer": p.answer
  } for p in job.train])
  batch = job.prompts_per_step * job.group_size
  args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), use_cpu=True, bf16=False, fp16=False, seed=job.seed,
                        max_steps=job.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                        num_generations=job.group_size, num_iterations=1, max_completion_length=job.max_new_tokens,
                        temperature=job.temperature, top_p=job.top_p, top_k=job.top_k, beta=0.0,
                        epsilon=job.clip_eps_low, epsilon_high=job.clip_eps_high, loss_type=TRL_LOSS[job.loss_agg],
                        scale_rewards="group", learning_rate=job.lr, warmup_steps=job.warmup_steps,
                        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": job.end_lr_ratio},
                        adam_beta1=job.b1, adam_beta2=job.b2, adam_epsilon=1e-8, weight_decay=job.weight_decay,
                        max_grad_norm=job.grad_clip, optim="adamw_torch", activation_checkpointing=False,
                        shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0, report_to="none",
                        save_strategy="no", logging_steps=1, disable_tqdm=True)
  res = SideResult("trl")
  clock = {}

  class Timed(trl.GRPOTrainer):
    """Times generate (with the tokens it made) and the whole rollout (generate, reward, advantages)."""

    def _generate_single_turn(self, prompt_ids, *a, **kw):
      t0 = time.perf_counter()
      completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
      clock.update(gen=time.perf_counter() - t0, gen_tokens=sum(len(c) for c in completion_ids),
                   train_tokens=sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)))
      return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
      t0 = time.perf_counter()
      out = super()._generate_and_score_completions(inputs)
      clock["rollout"] = time.perf_counter() - t0
      return out

  class Steps(transformers.TrainerCallback):

    def on_step_begin(self, *_, **__):
      clock["start"] = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      seconds = time.perf_counter() - clock["start"]
      res.steps.append(
          StepTime(state.global_step, seconds, clock["gen"], clock["gen_tokens"], seconds - clock["rollout"],
                   clock["train_tokens"]))
      if state.global_step in job.eval_steps():
        res.curve.append([state.global_step, greedy_accuracy_torch(kw["model"], tokenizer, job, reward)])

  res.curve.append([0, greedy_accuracy_torch(model, tokenizer, job, reward)])
  trainer = Timed(model=model, reward_funcs=task_reward_fn, args=args, train_dataset=data, processing_class=tokenizer,
                  callbacks=[Steps()])
  trainer.train()
  res.settings = {
      "trl": trl.__version__,
      "transformers": transformers.__version__,
      "torch": torch.__version__,
      "torch_threads": torch.get_num_threads(),
      "loss_type": args.loss_type,
      "activation_checkpointing": args.activation_checkpointing,
      "prompt_ids_equal": True,
      "advantage_std": "unbiased (n - 1) group std + 1e-4; ours: population std + 1e-6"
  }
  with open(result_path, "w") as f:
    json.dump(dataclasses.asdict(res), f)


def run_side_child(name: str, cmd: list, result_path: str) -> SideResult:
  """A side in its own process: its result file with the process's peak RSS and time."""
  if os.path.exists(result_path):
    os.remove(result_path)
  rc, rss, wall = run_logged(cmd, result_path + ".log")
  if not os.path.exists(result_path):
    return SideResult(name, error=failure(rc, rss, result_path + ".log"), peak_rss_gib=rss, wall_seconds=wall)
  with open(result_path) as f:
    res = SideResult.from_dict(json.load(f))
  res.peak_rss_gib, res.wall_seconds = rss, wall
  return res


# ---- Tunix --------------------------------------------------------------------------------------


def reward_server(job: Job):
  """Scores for the Tunix side (whose venv lacks this project's dependencies): one JSON line in,
  {"prompts", "completions", "answers"}, one out, {"rewards"}."""
  reward = task_reward(job)
  for line in sys.stdin:
    req = json.loads(line)
    rewards = [float(reward(*x)) for x in zip(req["prompts"], req["completions"], req["answers"])]
    print(json.dumps({"rewards": rewards}), flush=True)


def run_tunix(job_path: str, result_path: str) -> SideResult:
  if not os.path.exists(TUNIX_PY):
    return SideResult("tunix", error=f"{TUNIX_PY} is missing; run: bash benchmarks/setup_tunix.sh")
  reward_cmd = json.dumps([sys.executable, os.path.abspath(__file__), "--side", "reward", "--job", job_path])
  return run_side_child(
      "tunix",
      [TUNIX_PY, os.path.join(HERE, "train_tunix_side.py"), "grpo", job_path, result_path, reward_cmd], result_path)


# ---- report -------------------------------------------------------------------------------------


def ratios(sides: dict) -> dict:
  """theirs / ours of seconds per step and peak memory; ours / theirs of tokens/s."""
  out, ours = {}, sides["ours"]
  if ours.get("error"):
    return out
  for name, s in sides.items():
    if name == "ours" or s.get("error"):
      continue
    r = {}
    for key, inverse in (("step_s", True), ("wall_s", True), ("rollout_tokens_per_s", False),
                         ("train_tokens_per_s", False), ("peak_rss_gib", False)):
      a, b = ours["summary"].get(key), s["summary"].get(key)
      if a and b:
        r[key] = b / a if inverse or key == "peak_rss_gib" else a / b
    out[name] = r
  return out


def table(results: dict) -> str:
  job, sides = results["job"], results["sides"]
  cell = lambda v, fmt: "n/a" if v is None else fmt.format(v)
  rows = [
      "| side | s / RL step (median) | first step s | generation s | rollout tokens/s | train s | train tokens/s | "
      "peak RSS GiB | held-out before -> after | run wall s |", "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for name, s in sides.items():
    if s.get("error"):
      rows.append(f"| {name} | did not run: {s['error']} |" + " |" * 8)
      continue
    m = s["summary"]
    curve = " -> ".join(f"{acc:.3f}" for _, acc in s["curve"])
    rows.append(f"| {name} | {cell(m['step_s'], '{:.2f}')} | {cell(m['first_step_s'], '{:.1f}')} | "
                f"{cell(m['gen_s'], '{:.2f}')} | {cell(m['rollout_tokens_per_s'], '{:.0f}')} | "
                f"{cell(m['train_s'], '{:.2f}')} | {cell(m['train_tokens_per_s'], '{:.0f}')} | "
                f"{cell(m['peak_rss_gib'], '{:.2f}')} | {curve} | {cell(m['wall_s'], '{:.0f}')} |")
  lines = ["\n".join(rows), ""]
  for name, r in results["ratios"].items():
    lines.append(
        f"- ours against {name}: **{cell(r.get('step_s'), '{:.2f}x')} faster per RL step**, run wall "
        f"{cell(r.get('wall_s'), '{:.2f}x')}, rollout tokens/s {cell(r.get('rollout_tokens_per_s'), '{:.2f}x')}"
        f", train tokens/s {cell(r.get('train_tokens_per_s'), '{:.2f}x')}, peak memory {name} / ours "
        f"{cell(r.get('peak_rss_gib'), '{:.2f}x')}.")
  lines.append(f"\nJob: {os.path.relpath(job['config'], ROOT)} on {job['model_dir']}, {job['steps']} RL steps of "
               f"{job['prompts_per_step']} prompts x {job['group_size']} samples, {job['max_new_tokens']} new tokens, "
               f"temperature {job['temperature']}, lr {job['lr']:g} (warmup {job['warmup_steps']}), loss "
               f"{job['loss_agg']}; held-out greedy accuracy on {len(job['eval'])} questions at steps "
               f"{', '.join(str(s) for s, _ in next((s['curve'] for s in sides.values() if s.get('curve')), []))}. "
               f"Command: `{results['command']}`.")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--eval-size", type=int, default=96)
  ap.add_argument("--eval-every", type=int, default=10)
  ap.add_argument("--sides", default="ours,trl,tunix")
  ap.add_argument("--config", default=RECIPE, help=f"run config (default {os.path.relpath(RECIPE, ROOT)})")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a --config.KEY=VALUE override")
  ap.add_argument("--model-dir", help="the config's model_dir instead (a Hugging Face directory, a GGUF file)")
  ap.add_argument("--json", default=os.path.join(OUT, "vs_trl_tunix.json"))
  ap.add_argument("--readme", action="store_true", help="rewrite this benchmark's table in benchmarks/README.md")
  ap.add_argument("--side", choices=["trl", "reward"], help=argparse.SUPPRESS)  # a child's part
  ap.add_argument("--job", help=argparse.SUPPRESS)
  ap.add_argument("--result", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.side == "trl":
    return trl_side(Job.load(args.job), args.result)
  if args.side == "reward":
    return reward_server(Job.load(args.job))

  overrides = ([["model_dir", args.model_dir]] if args.model_dir else []) + [kv.split("=", 1) for kv in args.set]
  job = resolve_job(args.config, overrides, args.steps, args.eval_every, args.eval_size)
  os.makedirs(OUT, exist_ok=True)
  job_path = os.path.join(OUT, "job.json")
  job.save(job_path)
  sides = {}
  for name in args.sides.split(","):
    if name == "ours":
      res = run_ours(job, os.path.join(OUT, "ours"))
    elif name == "trl":
      path = os.path.join(OUT, "trl.json")
      res = run_side_child("trl", [sys.executable, __file__, "--side", "trl", "--job", job_path, "--result", path],
                           path)
    elif name == "tunix":
      res = run_tunix(job_path, os.path.join(OUT, "tunix.json"))
    else:
      raise SystemExit(f"--sides: unknown side {name!r} (ours, trl, tunix)")
    sides[name] = dict(dataclasses.asdict(res), summary=res.summary())
    print(f"{name}: {json.dumps(sides[name]['summary'])}{' error: ' + res.error if res.error else ''}", flush=True)
  command = "python benchmarks/vs_trl_tunix.py " + " ".join(sys.argv[1:])
  job_dict = dataclasses.asdict(job)
  job_dict["train"] = len(job.train)  # the prompts themselves are in job.json
  results = {"job": dict(job_dict, eval=[p.text for p in job.eval]), "sides": sides, "command": command.strip()}
  results["ratios"] = ratios(sides) if "ours" in sides else {}
  from readme_section import report
  report(args.json, results, table(results), args.readme, "vs-trl-tunix",
         "A real pretrained model: the same GRPO job against TRL and Tunix")


if __name__ == "__main__":
  main()
