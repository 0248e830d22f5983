"""The run config: defaults for every field, the checks of single fields, config files, command-line
overrides and the config.json a run saves. A leaf: it imports nothing of jaxrl_hex but errors, specs
and the model's shape defaults, so every layer can read it.

Config files are Python (`get_config()` returns an ml_collections.ConfigDict built on
base_config()); any field can be overridden on the command line as --config.a.b=value.
"""
import ast
import json
import os

import ml_collections

from jaxrl_hex.errors import ConfigError
from jaxrl_hex.models.config import AUTO, AUTO_FIELDS, DEFAULTS as MODEL_DEFAULTS
from jaxrl_hex.specs import load_module

# The mesh file a run uses unless its config names another. Its layout adapts to the model: a pool whose
# tensor axis cannot split the model's heads, MLP or vocab is laid out again (runtime.fit_mesh).
DEFAULT_MESH_FILE = "meshes/cpu-8.yaml"


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh_file = DEFAULT_MESH_FILE
  c.task = "arith"  # built-in name or path/to/file.py:make_task
  c.task_args = ml_collections.ConfigDict({"digits": 2, "eval_size": 256})
  c.model = ml_collections.ConfigDict(MODEL_DEFAULTS)
  # "auto" or a bool: scanned from 9 layers on (models.config.auto_scan_layers); model.dtype may be "auto" too
  c.model.scan_layers = ml_collections.FieldReference(AUTO, field_type=object)
  # a workdir to start RL from: its latest checkpoint, or WORKDIR:best its best one (train.keep_best) or
  # WORKDIR:N step N; "" = warm start
  c.init_from = ""
  c.model_dir = ""  # a Hugging Face model dir: architecture, tokenizer and first weights from it

  c.sft = ml_collections.ConfigDict(
      dict(max_steps=3000, batch_size=64, target_accuracy=0.4, eval_every=20, eval_size=256, lr=3e-3, warmup_steps=50,
           end_lr_ratio=1.0, b1=0.9, b2=0.98, weight_decay=0.0, grad_clip=1.0))

  c.rollout = ml_collections.ConfigDict(
      dict(
          prompts_per_step=32,
          group_size=8,
          max_new_tokens=6,
          temperature=1.0,
          top_k=0,
          top_p=1.0,
          reward_timeout_s=10.0,
          # engine (jaxrl_hex/rollout/engine.py): decode slots (0 = prompts_per_step x group_size), longest
          # prompt in tokens, extra stop ids ([] = the tokenizer's EOS) and stop strings, weight switch
          # mid-generation (recompute | finish), decode steps per host hand-back, per-device budget for
          # KV cache + weights in GiB (0 = the device's own limit where it reports one); a paged KV cache:
          # tokens per block (0 = contiguous, each slot reserves its longest sequence) and blocks in the pool
          # (0 = the contiguous cache's memory; with more slots than it holds longest sequences)
          min_p=0.0,
          slots=0,
          max_prompt_len=64,
          eos_ids=[],
          stop=[],
          interrupt="recompute",
          steps_per_sync=16,
          memory_budget_gb=0.0,
          kv_page_size=0,
          kv_blocks=0,
          # with LoRA (model.lora.rank > 0): unmerged = the engine applies the adapters beside the base,
          # merged = each version is folded into a copy of the targeted weights (sync/adapters.py)
          lora_serving="unmerged",
          # an environment's episodes (jaxrl_hex/tasks/environment.py): max_new_tokens is an episode's whole
          # budget after its first prompt (turns and observations); turn_tokens caps one turn (0 = no cap)
          turn_tokens=0))

  # The RL algorithm (jaxrl_hex/rl): pieces by registered name, presets in configs/{grpo,dapo,ppo,...}.py
  c.algo = ml_collections.ConfigDict(
      dict(
          advantage="grpo",  # grpo | drgrpo | rloo | reinforce_pp | gae (PPO; needs algo.critic)
          loss="ppo",  # ppo | dual_clip | gspo | cispo, all decoupled (behaviour/proximal/current)
          loss_agg="token-mean",  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
          clip_eps_low=0.2,
          clip_eps_high=0.28,  # asymmetric clip (DAPO clip-higher)
          dual_clip_c=3.0,  # dual_clip: objective floor c * A for A < 0
          behav_weight_cap=5.0,
          behav_weight_mode="mask",  # pi_prox/pi_behav above the cap: mask|truncate
          behav_weight_level="token",  # token | sequence (product over the sequence)
          kl_coef=0.0,  # > 0 keeps a frozen reference on the train pool
          kl_mode="loss",
          kl_estimator="k3",  # loss | reward (per-token penalty); k1 | k2 | k3
          entropy_coef=0.0,  # entropy bonus
          gamma=1.0,
          gae_lambda=1.0,  # reinforce_pp / gae discounting
          loss_norm_length=0,  # seq-mean-token-sum-norm divisor; 0 = max_new_tokens
          prox_logp="recompute",  # recompute | interpolate (log-linear by version)
          minibatches=1,  # optimizer updates per step (one per minibatch)
          pack=False,
          pack_length=0,  # pack sequences into rows (0 = padded width)
          share_prompts=False,  # run each group's prompt once (excludes pack)
          # token budget per micro-batch; 0 = no accumulation. Smaller programs fault fewer fresh pages
          # on CPU: ~1.5k tokens ran W3's step 1.1-1.2x faster (docs/troubleshooting.md)
          micro_batch_tokens=0,
          dynamic_sampling=False,
          dynamic_sampling_max_rounds=8,  # DAPO: drop zero-variance groups
          overlong_buffer=0,
          overlong_penalty=1.0,  # DAPO soft overlong punishment (0 = off)
          critic=ml_collections.ConfigDict(
              dict(  # lr > 0 builds a critic (value head); gae needs one
                  lr=0.0, vf_coef=0.5, value_clip=0.2, grad_clip=1.0))))

  c.optim = ml_collections.ConfigDict(
      dict(lr=3e-4, warmup_steps=20, end_lr_ratio=0.1, b1=0.9, b2=0.999, weight_decay=0.01, grad_clip=1.0))

  c.train = ml_collections.ConfigDict(
      dict(steps=400, max_staleness=2, eval_every=50, eval_size=256, checkpoint_every=100, keep_checkpoints=2,
           log_every=10, max_nonfinite_steps=3, stop_deadline_s=120.0, watchdog_s=900.0, keep_best=False,
           keep_best_by="eval_accuracy", keep_best_mode="max",
           resume_step=-1))  # resume_step: set by `train --resume --step=N` (-1: the newest intact)
  # max_nonfinite_steps: steps in a row whose every update was skipped for a non-finite loss or gradient
  # before the run stops (its checkpoints hold the last finite weights); stop_deadline_s: after SIGTERM or
  # SIGINT, seconds for the step in flight and its checkpoint before the process exits regardless;
  # watchdog_s: a run with no train step and no generated batch for this long stops (0: never);
  # keep_best: an evaluation whose keep_best_by (a key of the train rows, eval_accuracy or e.g. reward_mean)
  # beats every earlier one in the run (keep_best_mode max: higher is better, min: lower) is checkpointed, at
  # once if no checkpoint is due, and that checkpoint is kept beside the last keep_checkpoints and named in
  # checkpoints/best.json (`--step=best`, init_from=WORKDIR:best); the evaluation at step 0 does not count

  # directory "" = WORKDIR/sync; verify_every: check the rollout side's weights against the trainer's
  # fingerprint (sync/fingerprint.py) on every N-th version (0: never); probe_every: on every N-th version
  # (and at the start) the engines and the trainer score one fixed sequence, which must agree within
  # probe_tolerance nats per token (sync/probe.py; 0: never). transport (method direct): object_store
  # (Ray's, any hosts), shared_memory (one train process on its rollout processes' host: each version
  # written once into their layout, sync/shared_memory.py), auto (shared_memory where it can run)
  c.sync = ml_collections.ConfigDict(
      dict(method="device_put", transport="auto", directory="", verify_every=20, probe_every=50, probe_tolerance=0.02))

  c.cluster = ml_collections.ConfigDict(
      dict(
          backend="local",  # local: pools are device subsets of this process; ray: Ray actors
          ray_address="",  # "" starts a local Ray; else host:port, ray://host:port or auto
          worker_timeout_s=300.0,  # a rollout call running longer than this counts as a lost worker
          train_timeout_s=1800.0,  # a train call (step, publish, save) longer than this: a lost train process
          max_restarts=10))  # lost rollout workers replaced before the run gives up
  # metrics.jsonl always; TensorBoard under WORKDIR/tb; W&B when a project is named (needs `pip install wandb`)
  c.log = ml_collections.ConfigDict(dict(tensorboard=True, wandb_project="", wandb_entity="", wandb_run_name=""))
  return c


# field -> (is the value usable, what it must be, what it means). Each of these fails late and far
# from the field otherwise: a ZeroDivisionError mid-run, a grain traceback, a batch of nothing.
FIELD_CHECKS = {
    "train.steps": (lambda v: v >= 0, ">= 0", "RL steps after the warm start; 0 = the warm start only"),
    "train.eval_every": (lambda v: v >= 1, ">= 1", "RL steps between evaluations; the last step always evaluates, "
                         "so train.steps evaluates at the end only"),
    "train.checkpoint_every": (lambda v: v >= 1, ">= 1", "RL steps between checkpoints; the last step always "
                               "saves, so train.steps saves at the end only"),
    "train.keep_checkpoints": (lambda v: v >= 1, ">= 1", "checkpoints kept on disk"),
    "train.keep_best_by": (lambda v: isinstance(v, str) and v != "", "a metric name", "the train row key "
                           "train.keep_best compares at each evaluation, e.g. eval_accuracy"),
    "train.keep_best_mode": (lambda v: v in ("max", "min"), "max or min", "whether a higher or a lower "
                             "train.keep_best_by is better"),
    "train.max_nonfinite_steps": (lambda v: v >= 1, ">= 1", "steps in a row with only non-finite updates that "
                                  "stop the run"),
    "train.stop_deadline_s": (lambda v: v > 0, "> 0", "seconds after SIGTERM for the step and its checkpoint"),
    "train.watchdog_s": (lambda v: v >= 0, ">= 0", "seconds without progress that stop the run; 0 = never"),
    "sync.verify_every": (lambda v: v >= 0, ">= 0", "versions between weight-sync checks; 0 = never"),
    "sync.probe_every": (lambda v: v >= 0, ">= 0", "versions between logprob probes; 0 = never"),
    "sync.probe_tolerance": (lambda v: v > 0, "> 0", "the largest per-token logprob gap (nats) the probe allows"),
    "optim.lr": (lambda v: v > 0, "> 0", "the RL peak learning rate"),
    "sft.lr": (lambda v: v > 0, "> 0", "the warm start's peak learning rate"),
    "sft.max_steps": (lambda v: v >= 0, ">= 0", "the warm start's step limit; it stops sooner at sft.target_accuracy"),
    "sft.batch_size": (lambda v: v >= 1, ">= 1", "records per warm-start step"),
    "sft.eval_every": (lambda v: v >= 1, ">= 1", "warm-start steps between evaluations"),
    "rollout.prompts_per_step": (lambda v: v >= 1, ">= 1", "prompts in each RL batch"),
    "rollout.group_size": (lambda v: v >= 1, ">= 1", "samples per prompt"),
    "rollout.max_new_tokens": (lambda v: v >= 1, ">= 1", "the longest completion in tokens"),
    "rollout.max_prompt_len": (lambda v: v >= 1, ">= 1", "the longest prompt in tokens, BOS included"),
    "rollout.turn_tokens": (lambda v: v >= 0, ">= 0", "an episode turn's most tokens; 0 = no cap"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1]", "nucleus sampling's probability mass; 1.0 = off"),
    "rollout.top_k": (lambda v: v >= 0, ">= 0", "sample among the k likeliest tokens; 0 = off"),
    "rollout.lora_serving": (lambda v: v in ("unmerged", "merged"), "unmerged or merged", "how the engine applies "
                             "LoRA adapters: beside the base, or folded into a copy of the targeted weights"),
    "rollout.min_p": (lambda v: 0 <= v < 1, "in [0, 1)", "drop tokens under min_p x the likeliest's probability; "
                      "0 = off"),
}


def validate_fields(cfg, tokenizer=None):
  """Checks of single fields (the cross-layer ones are runtime.validate's); raises ConfigError."""
  for field in FIELD_CHECKS:
    section, key = field.split(".")
    check_field(field, cfg[section][key])
  if cfg.train.max_staleness < 0:
    raise ConfigError("train.max_staleness must be >= 0 (0 = synchronous, on-policy RL)")
  check_paged_kv(cfg.rollout.kv_page_size, cfg.rollout.kv_blocks)
  if cfg.rollout.temperature <= 0:
    raise ConfigError("rollout.temperature must be > 0 for RL sampling; greedy decoding is used for eval only")
  if tokenizer is not None and cfg.model.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the task tokenizer's "
                      f"{tokenizer.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size} or more")


def check_field(field: str, value, flag: str = ""):
  """One FIELD_CHECKS field; `flag`: the command-line flag that set it when not --config.FIELD."""
  ok, need, meaning = FIELD_CHECKS[field]
  try:
    if ok(value):
      return
  except TypeError:  # a config file's None or string where a number goes
    pass
  section, key = field.split(".")
  default = base_config()[section][key]
  if flag:
    raise ConfigError(f"{flag}={value!r} must be {need} ({meaning}; it sets {field}), e.g. {flag}={default!r}")
  raise ConfigError(f"{field}={value!r} must be {need} ({meaning}); e.g. --config.{field}={default!r} (the default)")


def check_paged_kv(page_size: int, blocks: int):
  """rollout.kv_page_size and rollout.kv_blocks on their own (the engine checks them against its pool)."""
  if page_size < 0 or blocks < 0:
    raise ConfigError(f"rollout.kv_page_size={page_size} and rollout.kv_blocks={blocks} must be >= 0 "
                      "(kv_page_size 0 = the contiguous KV cache; kv_blocks 0 = the contiguous cache's memory)")
  if blocks and not page_size:
    raise ConfigError(f"rollout.kv_blocks={blocks} sizes a paged KV cache; set rollout.kv_page_size > 0 "
                      "(tokens per block, e.g. 16) or leave kv_blocks at 0")


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """A config file's get_config(), as --config=path loads it."""
  module = load_module(resolve_path(path), "--config")
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config: {path} has no get_config(); define one returning a ConfigDict built on "
                      "jaxrl_hex.config.base_config()")
  return module.get_config()


def apply_overrides(cfg, overrides):
  """--config.a.b=value pairs (key "a.b", value as typed) onto cfg, each parsed as its field's type."""
  for key, text in overrides:
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents + [leaf]:
      if not hasattr(node, "keys") or part not in node:
        raise ConfigError(unknown_key_message(cfg, key))
      parent, node = node, node[part]
    if isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(f"--config.{key} is a section, not a field; set its fields, e.g. "
                        f"--config.{key}.{sorted(node.keys())[0]}=...")
    like, kind = node, type(node).__name__
    if parents == ["model"] and leaf in AUTO_FIELDS:  # "auto", or a value of the field's own type
      like = AUTO if text == AUTO else MODEL_DEFAULTS[leaf]
      kind = f"{type(MODEL_DEFAULTS[leaf]).__name__} or {AUTO!r}"
    try:
      parent[leaf] = _parse(text, like)
    except (TypeError, ValueError, SyntaxError):
      raise ConfigError(f"--config.{key}={text!r} is not a {kind} (the field's default is {node!r})") from None


def _parse(text: str, current):
  """A command-line string as the type of the field's current value (strings stay as typed)."""
  if isinstance(current, bool):
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
      raise ValueError(text)
    return words[text.lower()]
  if isinstance(current, str):
    return text
  if isinstance(current, int):
    return int(text)
  if isinstance(current, float):
    return float(text)
  try:  # lists, tuples, dicts and None-valued fields: a Python literal, else the string itself
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if current is None:
      return text
    raise


def write_run_config(cfg, workdir: str):
  """config.json in the workdir: the resolved config a run (or `convert --from-hf`) ran with."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort(indent=2))


def config_from_json(text: str) -> ml_collections.ConfigDict:
  """A config serialised with to_json_best_effort, on top of base_config() so fields added since
  the run was saved get their defaults."""
  cfg = base_config()
  saved = json.loads(text)
  _merge(cfg, saved)
  return cfg


def _merge(node, saved: dict):
  for key, value in saved.items():
    if isinstance(node.get(key), ml_collections.ConfigDict) and isinstance(value, dict):
      _merge(node[key], value)
    else:
      with node.ignore_type():
        node[key] = value


def read_run_config(workdir: str, field: str = "--workdir") -> ml_collections.ConfigDict:
  """The config a run in `workdir` saved (see write_run_config); `field` names the flag in errors."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"{field}: {path} does not exist; point {field} at a train or sft run")
  with open(path) as f:
    return config_from_json(f.read())


def unknown_key_message(cfg, key: str) -> str:
  parent, _, leaf = key.rpartition(".")
  node = cfg
  for part in filter(None, parent.split(".")):
    if part not in node:
      return f"unknown config key {key!r}: {part!r} is not a section; sections: {sorted(cfg.keys())}"
    node = node[part]
  known = sorted(node.keys()) if hasattr(node, "keys") else []
  return f"unknown config key {key!r}; known keys{' under ' + parent if parent else ''}: {', '.join(known)}"


def resolve_path(path: str) -> str:
  """Relative paths resolve against the cwd, then against the repository root."""
  if not path or os.path.isabs(path) or os.path.exists(path):
    return path
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  candidate = os.path.join(root, path)
  return candidate if os.path.exists(candidate) else path
