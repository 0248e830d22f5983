"""jaxrl-hex convert: Hugging Face model directories <-> our runs, both ways.

  jaxrl-hex convert --from-hf=/models/Qwen2.5-Math-1.5B --out=runs/qwen   # Orbax checkpoint + config.json
  jaxrl-hex train --config=configs/gsm8k_grpo.py --config.model_dir=/models/Qwen2.5-Math-1.5B \\
      --config.init_from=runs/qwen ...
  jaxrl-hex convert --to-hf=runs/gsm8k --out=runs/gsm8k/hf [--dtype=bfloat16]  # transformers / vLLM load it

--from-hf writes a directory shaped like a run (config.json + checkpoints/0), so --config.init_from,
`generate --workdir` and `convert --to-hf` all take it. --to-hf exports a run's latest (or --step)
params with its source model's config.json fields and tokenizer files (the run's model_dir).
"""
import os

import jax

from jaxrl_hex import arguments, meshes
from jaxrl_hex.checkpoint import Checkpointer, CheckpointError
from jaxrl_hex.config import base_config, read_run_config, resolve_path, write_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.generate import saved_step
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.hf import hf_model_config, load_params, save_hf
from jaxrl_hex.models.policy import Policy

# Weight dtypes that both our models and Hugging Face loaders (transformers, vLLM) take
DTYPES = ("float32", "bfloat16", "float16")


def _parser():
  ap = arguments.Parser("jaxrl-hex convert", __doc__.splitlines()[0])
  way = ap.add_mutually_exclusive_group(required=True)
  way.add_argument("--from-hf", metavar="MODEL_DIR", help="a Hugging Face model directory to read")
  way.add_argument("--to-hf", metavar="WORKDIR", help="a train / sft run (or a --from-hf output) to export")
  ap.add_argument("--out", required=True, help="directory to write")
  ap.add_argument("--dtype", default=None, help="weights' dtype in the output (default: as stored)")
  ap.add_argument("--step", type=int, default=None, help="--to-hf: checkpoint step (default: the latest)")
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
  print(f"wrote {out}: start a run from it with --config.model_dir={model_dir} --config.init_from={out}")


def to_hf(workdir: str, out: str, dtype=None, step=None):
  run = read_run_config(workdir, "--to-hf")
  ckpt_dir = saved_step(workdir, step, "--to-hf")
  cfg = model_config(**run.model)
  policy = Policy.build(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), policy.shapes())
  params = Checkpointer(ckpt_dir).restore({"params": like}, step, with_meta=False)[0]
  source = resolve_path(run.model_dir) if run.model_dir else None
  save_hf(cfg, params["params"], out, source, dtype)
  print(f"wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({out!r}) loads it")


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
  if args.from_hf:
    from_hf(args.from_hf, args.out, args.dtype, args.mesh_file)
  else:
    to_hf(args.to_hf, args.out, args.dtype, args.step)


def main(argv) -> int:
  return arguments.run(_parser(), _convert, argv)
