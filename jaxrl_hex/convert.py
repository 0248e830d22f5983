"""jaxrl-hex convert: Hugging Face model directories <-> our runs, both ways.

  jaxrl-hex convert --from-hf=/models/Qwen2.5-Math-1.5B --out=runs/qwen   # Orbax checkpoint + config.json
  jaxrl-hex train --config=configs/gsm8k_grpo.py --config.model_dir=/models/Qwen2.5-Math-1.5B \\
      --config.init_from=runs/qwen ...
  jaxrl-hex convert --to-hf=runs/gsm8k --out=runs/gsm8k/hf [--step=N] [--dtype=bfloat16] [--force]

--from-hf writes a directory shaped like a run (config.json + checkpoints/0), so --config.init_from,
`generate --workdir` and `convert --to-hf` all take it. --to-hf exports a run's latest (or --step)
params as a directory that transformers.AutoModelForCausalLM / AutoTokenizer and vLLM load: the
weights, config.json (the source model's fields kept), the tokenizer the run read its task with
(the source model's files and chat template, or the built-in character tokenizer as a
tokenizer.json) and a generation_config.json with the run's token ids and sampling, so greedy
generate() continues a prompt as the run's engine does.
"""
import glob
import json
import os
import shlex
import shutil

import jax

from jaxrl_hex import arguments, meshes
from jaxrl_hex.checkpoint import Checkpointer, CheckpointError, step_arg
from jaxrl_hex.config import base_config, read_run_config, resolve_path, write_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.generate import saved_step
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.hf import TOKENIZER_FILES, generation_config, hf_model_config, load_params, save_hf
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl_hex.tasks import load_task

# Weight dtypes that both our models and Hugging Face loaders (transformers, vLLM) take
DTYPES = ("float32", "bfloat16", "float16")


def _parser():
  ap = arguments.Parser("jaxrl-hex convert", __doc__.splitlines()[0])
  way = ap.add_mutually_exclusive_group(required=True)
  way.add_argument("--from-hf", metavar="MODEL_DIR", help="a Hugging Face model directory to read")
  way.add_argument("--to-hf", metavar="WORKDIR", help="a train / sft run (or a --from-hf output) to export")
  ap.add_argument("--out", required=True, help="directory to write")
  ap.add_argument("--dtype", default=None, help="weights' dtype in the output (default: as stored)")
  ap.add_argument("--step", type=step_arg, default=None,
                  help="--to-hf: checkpoint step, or best (train.keep_best's best evaluation); default: the latest")
  ap.add_argument("--force", action="store_true", help="--to-hf: write into a non-empty --out, replacing its model")
  ap.add_argument("--mesh-file", default=None,
                  help="--from-hf: place the weights on this mesh file's train pool (default: one device)")
  return ap


def from_hf(model_dir: str, out: str, dtype=None, mesh_file=None):
  ckpt_dir = os.path.join(out, "checkpoints")
  if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
    raise CheckpointError(f"--out: {out} already holds checkpoints; pick an empty directory")
  model_dir = os.path.abspath(resolve_path(model_dir))
  try:
    cfg = hf_model_config(model_dir, **({"param_dtype": dtype} if dtype else {}))
  except UserError as e:  # it names the directory; name the flag too
    raise UserError(f"--from-hf: {e}") from None
  policy = Policy.build(cfg)
  if mesh_file:
    shardings = _train_pool(mesh_file).shardings_for(policy.logical_axes(), policy.shapes())
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, policy.shapes())
  params = load_params(model_dir, cfg, shardings)
  run = base_config()
  run.model, run.model_dir = cfg, model_dir
  write_run_config(run, out)
  checkpointer = Checkpointer(ckpt_dir, keep=1)
  checkpointer.save(0, {"params": params}, {"phase": "convert", "source": model_dir})
  checkpointer.close()
  print(f"wrote {out}; start a run from it: jaxrl-hex train --config.model_dir={shlex.quote(model_dir)} "
        f"--config.init_from={shlex.quote(out)}")


def to_hf(workdir: str, out: str, dtype=None, step=None, force=False):
  run = read_run_config(workdir, "--to-hf")
  _check_out(workdir, out, force)
  ckpt_dir = saved_step(workdir, step, "--to-hf")
  source = resolve_path(run.model_dir) if run.model_dir else None
  tokenizer, note = run_tokenizer(run, source)  # before any weight is read: a task that does not load stops here
  cfg = model_config(**run.model)
  policy = Policy.build(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), policy.shapes())
  params, meta = Checkpointer(ckpt_dir).restore({"params": like}, step)
  if force:  # shards of an earlier export that this one does not rewrite would load with it
    for pattern in ("*.safetensors", "*.safetensors.index.json"):
      for stale in glob.glob(os.path.join(out, pattern)):
        os.remove(stale)
  save_hf(cfg, params["params"], out, source, dtype)
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
  if args.from_hf and args.step is not None:
    raise UserError(f"--step={args.step} picks the checkpoint --to-hf exports; --from-hf writes step 0, drop --step")
  if args.from_hf and args.force:
    raise UserError("--force: --from-hf never writes over a run's checkpoints; drop --force and pick an empty --out")
  if args.from_hf:
    from_hf(args.from_hf, args.out, args.dtype, args.mesh_file)
  else:
    to_hf(args.to_hf, args.out, args.dtype, args.step, args.force)


def main(argv) -> int:
  return arguments.run(_parser(), _convert, argv)
