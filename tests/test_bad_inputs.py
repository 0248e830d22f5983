"""Bad input, one table: each row is a command line that must stop with exit status 2 and one line
naming the field at fault, before any work starts (no runtime, engine or model is built, no run
directory written, nothing compiles)."""
import json
import os

import numpy as np
import pytest
from support import SMALL, load_config

from jaxrl_hex import cli, convert, generate, runtime
from jaxrl_hex.checkpoint import Checkpointer

BAD_YAML = "pools:\n  train: {devices: 4, mesh: {fsdp: 4}\n  rollout: {devices: 4}\n"  # an unclosed brace
MESH_8_ON_12 = ("platform: cpu\nnum_devices: 8\npools:\n  train: {devices: 8, mesh: {fsdp: 8}}\n"
                "  rollout: {devices: 4, mesh: {data: 4}}\n")
PROMPT = '{"prompt": "12+30="}\n'
ENV_JSON_FORMAT = ("from jaxrl_hex.tasks import EnvTask\nclass E:\n  pass\n"
                   "def make_env(config):\n  return EnvTask('e', [{'q': 1}], [{'q': 1}], E, tool_format='json')\n")

GEN = "generate --workdir={run} --prompts={tmp}/p.jsonl --out={tmp}/o.jsonl"
MESH = "train --config.mesh_file={tmp}/m.yaml"

# (name, command line, text its one line must hold: the field and the fix). {tmp} is a fresh directory
# holding the row's FILES, {run} a run with config.json and a checkpoint at step 12, {bare} one with
# config.json and no checkpoint. train / sft lines get --workdir={tmp}/w unless they name one.
CASES = [
    # single config fields (config.validate_fields)
    ("train.steps<0", "train --config.train.steps=-1", "train.steps=-1 must be >= 0"),
    ("optim.lr=0", "train --config.optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("optim.lr<0", "train --config.optim.lr=-1e-4", "optim.lr=-0.0001 must be > 0"),
    ("sft.lr=0", "sft --config.sft.lr=0", "sft.lr=0.0 must be > 0"),
    ("top_p>1", "train --config.rollout.top_p=1.5", "rollout.top_p=1.5 must be in (0, 1]"),
    ("top_p=0", "train --config.rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]"),
    ("top_k<0", "train --config.rollout.top_k=-1", "rollout.top_k=-1 must be >= 0"),
    ("min_p=1", "train --config.rollout.min_p=1", "rollout.min_p=1.0 must be in [0, 1)"),
    ("eval_every=0", "train --config.train.eval_every=0", "train.eval_every=0 must be >= 1"),
    ("checkpoint_every=0", "train --config.train.checkpoint_every=0", "train.checkpoint_every=0 must be >= 1"),
    ("keep_checkpoints=0", "train --config.train.keep_checkpoints=0", "train.keep_checkpoints=0 must be >= 1"),
    ("max_new_tokens=0", "train --config.rollout.max_new_tokens=0", "rollout.max_new_tokens=0 must be >= 1"),
    ("max_prompt_len=0", "train --config.rollout.max_prompt_len=0", "rollout.max_prompt_len=0 must be >= 1"),
    ("sft.batch_size=0", "sft --config.sft.batch_size=0", "sft.batch_size=0 must be >= 1"),
    # model fields (models/config.py)
    ("attention_kernel", "train --config.model.attention_kernel=triton",
     "model config: attention_kernel='triton'; use one of ('auto', 'portable', 'pallas')"),
    # LoRA (models/config.py check_lora; a base that does not match is tests/test_cli.py's)
    ("lora.rank>dim", "train --config.model.lora.rank=100", "model.lora.rank=100 is larger than"),
    ("lora.targets", "train --config.model.lora.rank=4 --config.model.lora.targets=('qproj',)",
     "model.lora.targets: ['qproj'] match(es) no layer"),
    ("lora_serving", "train --config.rollout.lora_serving=fused",
     "rollout.lora_serving='fused' must be unmerged or merged"),
    ("sft lora no base", "sft --config.model.lora.rank=4", "has none: set --config.model_dir"),
    ("sft.eval_every=0", "sft --config.sft.eval_every=0", "sft.eval_every=0 must be >= 1"),
    ("sft.max_steps<0", "sft --config.sft.max_steps=-5", "sft.max_steps=-5 must be >= 0"),
    ("prompts_per_step=0", "train --config.rollout.prompts_per_step=0", "rollout.prompts_per_step=0 must be >= 1"),
    ("group_size=0", "train --config.rollout.group_size=0 --config.algo.advantage=reinforce_pp",
     "rollout.group_size=0 must be >= 1"),
    ("temperature=0", "train --config.rollout.temperature=0", "rollout.temperature must be > 0"),
    ("max_staleness<0", "train --config.train.max_staleness=-1", "train.max_staleness must be >= 0"),
    ("kv_blocks without pages", "train --config.rollout.kv_blocks=8", "rollout.kv_blocks=8 sizes a paged"),
    ("max_nonfinite_steps=0", "train --config.train.max_nonfinite_steps=0", "train.max_nonfinite_steps=0 must be"),
    ("stop_deadline_s=0", "train --config.train.stop_deadline_s=0", "train.stop_deadline_s=0.0 must be > 0"),
    ("watchdog_s<0", "train --config.train.watchdog_s=-1", "train.watchdog_s=-1.0 must be >= 0"),
    ("verify_every<0", "train --config.sync.verify_every=-1", "sync.verify_every=-1 must be >= 0"),
    ("probe_every<0", "train --config.sync.probe_every=-1", "sync.probe_every=-1 must be >= 0"),
    ("probe_tolerance=0", "train --config.sync.probe_tolerance=0.0", "sync.probe_tolerance=0.0 must be > 0"),
    ("keep_best_mode", "train --config.train.keep_best_mode=up", "train.keep_best_mode='up' must be max or min"),
    ("keep_best_by empty", "train --config.train.keep_best_by=", "train.keep_best_by='' must be a metric name"),
    ("step without resume", "train --step=3", "--step=3 picks the checkpoint --resume continues from; add --resume"),
    # the command line and the config file
    ("unknown key", "train --config.train.stepz=3", "unknown config key 'train.stepz'"),
    ("not an int", "train --config.train.steps=many", "--config.train.steps='many' is not a int"),
    ("override without value", "sft --config.sft.max_steps", "--config.sft.max_steps needs a value"),
    ("missing config file", "train --config={tmp}/nope.py", "--config: file '{tmp}/nope.py' does not exist"),
    ("config not .py", "train --config={tmp}/grpo.yaml", "--config: '{tmp}/grpo.yaml' is not a .py file"),
    ("config without get_config", "train --config={tmp}/c.py", "--config: {tmp}/c.py has no get_config()"),
    ("resume without a run", "train --resume", "--resume"),
    # cross-field and backend checks (runtime.validate, cluster.check_config, the algorithm registry)
    ("batch vs data axis", "train --config.rollout.prompts_per_step=3 --config.rollout.group_size=3",
     "rollout.prompts_per_step x rollout.group_size = 9"),
    ("grpo group of 1", "train --config.rollout.group_size=1", "rollout.group_size=1 with algo.advantage='grpo'"),
    ("unknown backend", "train --config.cluster.backend=slurm", "cluster.backend='slurm'"),
    ("unknown sync", "train --config.sync.method=rsync", "sync.method='rsync'"),
    ("direct sync, local", "train --config.sync.method=direct", "sync.method=direct"),
    ("unknown sync transport", "train --config.sync.transport=nfs", "sync.transport='nfs'"),
    # mesh files (meshes.load_mesh_file)
    ("mesh missing", "train --config.mesh_file={tmp}/none.yaml", "mesh_file: '{tmp}/none.yaml' does not exist"),
    ("mesh a directory", "train --config.mesh_file={tmp}", "mesh_file: '{tmp}' is a directory"),
    ("mesh bad YAML", MESH, "{tmp}/m.yaml: not valid YAML (expected ',' or '}}', but got '<scalar>' at line 3"),
    ("mesh a list", MESH, "{tmp}/m.yaml: the top level is a list, not a mapping"),
    ("mesh a string", MESH.replace("train", "sft"), "{tmp}/m.yaml: the top level is a str, not a mapping"),
    ("mesh pool a list", MESH, "{tmp}/m.yaml: pools.train is a list, not a mapping"),
    ("mesh axes a list", MESH, "{tmp}/m.yaml: pools.train.mesh must map mesh axes to positive sizes"),
    ("mesh without pools", MESH, "{tmp}/m.yaml: needs a 'pools:' mapping"),
    ("mesh past num_devices", MESH, "device ids up to 11 but num_devices is 8"),
    # tasks: every prompt measured as the task loads, not when its batch comes up
    ("task prompts too long", "train --config.rollout.max_prompt_len=6",
     "rollout.max_prompt_len=6: 7844 of 7844 train prompts and 256 of 256 eval prompts of task 'arith2' are longer "
     "(up to 7 tokens, BOS included); raise it, e.g. --config.rollout.max_prompt_len=7"),
    ("task file missing", "train --config.task={tmp}/task.py:make_task", "task: file '{tmp}/task.py' does not exist"),
    ("task function missing", "train --config.task={tmp}/task.py:make_it", "no function 'make_it'"),
    ("task not a spec", "sft --config.task=arithmetic", "task: 'arithmetic' is neither a built-in task"),
    # environments (tasks/environment.py): the same loading, their own checks
    ("env file missing", "train --config.task={tmp}/env.py:make_env", "task: file '{tmp}/env.py' does not exist"),
    ("env function missing", "train --config.task={tmp}/env.py:make_envv", "has no function 'make_envv'"),
    ("env returns the wrong type", "train --config.task={tmp}/env.py:make_env",
     "task: {tmp}/env.py:make_env returned dict, not jaxrl_hex.tasks.Task, EnvTask or AgentTask"),
    ("env unknown tool format", "train --config.task={tmp}/env.py:make_env",
     "tool_format='json': expected one of ['hermes', 'tags']"),
    ("env first prompt too long", "train --config.task=guess --config.rollout.max_prompt_len=4",
     "rollout.max_prompt_len=4: 248 of 248 train prompts and 31 of 31 eval prompts of task 'guess31' are longer"),
    ("turn_tokens<0", "train --config.rollout.turn_tokens=-1", "rollout.turn_tokens=-1 must be >= 0"),
    # generate
    ("generate: prompt past max_seq_len", GEN, "line 1 of {tmp}/p.jsonl is 5001 tokens (BOS included), longer than "
     "the model's max_seq_len=4096 (model.max_seq_len"),
    ("generate: prompt past max_prompt_len", GEN, "1 of 2 prompts in {tmp}/p.jsonl are longer than "
     "rollout.max_prompt_len=64 (line 2: 101 tokens, BOS included); pass --max-prompt-len=101"),
    ("generate: missing step", GEN + " --step=5", "--step=5: {run} has no checkpoint at step 5; it has steps [12]"),
    ("generate: out a directory", GEN + " --out={tmp}", "--out={tmp} is a directory"),
    ("generate: out in no directory", GEN + " --out={tmp}/no/o.jsonl", "directory {tmp}/no does not exist"),
    ("generate: samples=0", GEN + " --samples=0", "--samples=0 must be >= 1"),
    ("generate: a line's n=0", GEN, "line 2 of {tmp}/p.jsonl asks for n=0 samples"),
    ("generate: more samples than slots", GEN + " --samples=33",
     "asks for 33 samples but the engine has 32 decode slots (rollout.slots); pass --slots=34"),
    ("generate: no checkpoint", GEN.replace("{run}", "{bare}"), "--workdir: {bare} holds no checkpoint yet"),
    ("generate: no run", GEN.replace("{run}", "{tmp}"), "--workdir: {tmp}/config.json does not exist"),
    ("generate: missing prompts", GEN, "--prompts: '{tmp}/p.jsonl' does not exist"),
    ("generate: empty prompts", GEN, "--prompts: {tmp}/p.jsonl holds nothing"),
    ("generate: not JSON", GEN, "--prompts: line 1 of {tmp}/p.jsonl is not"),
    ("generate: top-p", GEN + " --top-p=2", "--top-p=2.0 must be in (0, 1]"),
    ("generate: max-new-tokens", GEN + " --max-new-tokens=0", "--max-new-tokens=0 must be >= 1"),
    # convert
    ("convert: dtype to-hf", "convert --to-hf={run} --out={tmp}/hf --dtype=float7", "--dtype='float7' is not a weight"),
    ("convert: dtype from-hf", "convert --from-hf={tmp} --out={tmp}/r --dtype=float7", "--dtype='float7' is not a"),
    ("convert: missing step", "convert --to-hf={run} --out={tmp}/hf --step=3", "--step=3: {run} has no checkpoint"),
    ("convert: no checkpoint", "convert --to-hf={bare} --out={tmp}/hf", "--to-hf: {bare} holds no checkpoint yet"),
    ("convert: no run", "convert --to-hf={tmp} --out={tmp}/hf", "--to-hf: {tmp}/config.json does not exist"),
    ("convert: not an HF dir", "convert --from-hf={tmp} --out={tmp}/r", "--from-hf: {tmp}: no config.json"),
    ("generate: no best", GEN + " --step=best", "--step=best: {run} has no best checkpoint (no {run}/checkpoints/"
     "best.json): it trained without --config.train.keep_best=True"),
    ("generate: not a step", GEN + " --step=last", "argument --step: 'last' is not a checkpoint: pass a step number"),
    # eval
    ("eval: samples=0", "eval --workdir={run} --samples=0", "--samples=0 must be >= 1"),
    ("eval: eval-size=0", "eval --workdir={run} --eval-size=0", "--eval-size=0 must be >= 1"),
    ("eval: temperature without samples", "eval --workdir={run} --temperature=0.7",
     "--temperature=0.7 sets how --samples=k samples; add e.g. --samples=8"),
    ("eval: missing step", "eval --workdir={run} --step=5", "--step=5: {run} has no checkpoint at step 5; it has steps "
     "[12]"),
    ("eval: no best", "eval --workdir={run} --step=best", "--step=best: {run} has no best checkpoint"),
    ("eval: no run", "eval --workdir={tmp}", "--workdir: {tmp}/config.json does not exist"),
    ("eval: no checkpoint", "eval --workdir={bare}", "--workdir: {bare} holds no checkpoint yet"),
    ("eval: no source", "eval --samples=4", "one of the arguments --workdir --model-dir is required"),
    ("eval: config with a run", "eval --workdir={run} --config=configs/grpo.py", "--config=configs/grpo.py: --workdir "
     "is scored with the run's saved config.json"),
    ("eval: missing records", "eval --workdir={run} --prompts={tmp}/e.jsonl", "--prompts: '{tmp}/e.jsonl' does not "
     "exist"),
    ("eval: records without answers", "eval --workdir={run} --prompts={tmp}/e.jsonl", "--prompts: line 2 of "
     "{tmp}/e.jsonl has no 'answer'; each line is {{\"prompt\": ..., \"answer\": ...}}"),
    ("eval: records not JSON", "eval --workdir={run} --prompts={tmp}/e.jsonl", "--prompts: line 1 of {tmp}/e.jsonl is "
     "not JSON"),
    ("eval: model dir and step", "eval --model-dir={tmp} --step=3", "--step picks a checkpoint of --workdir"),
    ("eval: not a model dir", "eval --model-dir={tmp} --out={tmp}/e.json", "--model-dir: {tmp} has no config.json"),
    ("eval: model dir without out", "eval --model-dir={tmp}", "--model-dir: there is no run directory to write"),
    ("eval: out a directory", "eval --workdir={run} --out={tmp}", "--out={tmp} is a directory"),
    # every command
    ("unknown flag", GEN + " --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("unknown command", "trian", "unknown command 'trian'"),
]
FILES = {  # name -> {file in {tmp}: text}
    "config not .py": {"grpo.yaml": ""},
    "config without get_config": {"c.py": "X = 1\n"},
    "mesh bad YAML": {"m.yaml": BAD_YAML},
    "mesh a list": {"m.yaml": "- train\n- rollout\n"},
    "mesh a string": {"m.yaml": "cpu-8\n"},
    "mesh pool a list": {"m.yaml": "pools:\n  train: [0, 1]\n"},
    "mesh axes a list": {"m.yaml": "pools:\n  train: {devices: 4, mesh: [4]}\n"},
    "mesh without pools": {"m.yaml": "platform: cpu\n"},
    "mesh past num_devices": {"m.yaml": MESH_8_ON_12},
    "task function missing": {"task.py": "X = 1\n"},
    "env function missing": {"env.py": "def make_env(config):\n  return None\n"},
    "env returns the wrong type": {"env.py": "def make_env(config):\n  return {'train': []}\n"},
    "env unknown tool format": {"env.py": ENV_JSON_FORMAT},
    "generate: prompt past max_seq_len": {"p.jsonl": json.dumps({"prompt": "1" * 5000}) + "\n"},
    "generate: prompt past max_prompt_len": {"p.jsonl": PROMPT + json.dumps({"prompt": "1" * 100}) + "\n"},
    "generate: a line's n=0": {"p.jsonl": PROMPT + '{"prompt": "1+1=", "n": 0}\n'},
    "generate: missing prompts": {},
    "generate: empty prompts": {"p.jsonl": "\n"},
    "generate: not JSON": {"p.jsonl": "12+30=\n"},
    "eval: records without answers": {"e.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "7+5="}\n'},
    "eval: records not JSON": {"e.jsonl": "12+30=\n"},
    "eval: not a model dir": {"weights.safetensors": ""},
    "eval: model dir without out": {"config.json": "{}"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{run}: config.json and a checkpoint at step 12 (a stand-in tree: every row stops before it is
  read); {bare}: config.json only."""
  cfg = load_config(**SMALL)
  out = {}
  for name in ("run", "bare"):
    out[name] = str(tmp_path_factory.mktemp(name))
    with open(os.path.join(out[name], "config.json"), "w") as f:
      f.write(cfg.to_json_best_effort())
  ckpt = Checkpointer(os.path.join(out["run"], "checkpoints"))
  ckpt.save(12, {"params": {"w": np.zeros(2, np.float32)}}, {"policy_version": 12})
  ckpt.close()
  return out


def _no_work(what):

  def refuse(*args, **kwargs):
    raise AssertionError(f"work started ({what}) before the bad input was refused")

  return refuse


@pytest.mark.parametrize("name, line, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_naming_the_field(name, line, message, runs, tmp_path, capsys, monkeypatch):
  fill = lambda s: s.format(tmp=tmp_path, **runs)
  files = FILES.get(name, {"p.jsonl": PROMPT} if line.startswith("generate") else {})
  for file, text in files.items():
    (tmp_path / file).write_text(text)
  argv = [fill(a) for a in line.split()]
  workdir = tmp_path / "w"
  if argv[0] in ("train", "sft") and not any(a.startswith("--workdir") for a in argv):
    argv.append(f"--workdir={workdir}")
  if argv[0] in ("train", "sft"):  # generate checks its prompts on a runtime (it builds no pool or engine)
    monkeypatch.setattr(runtime, "Runtime", _no_work("a runtime"))
  monkeypatch.setattr(generate, "Engine", _no_work("the rollout engine"))
  monkeypatch.setattr(convert, "Policy", _no_work("a model"))
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("jaxrl-hex: error: ") and "\n" not in err, err
  assert fill(message) in err, err
  if "--resume" not in argv and name != "step without resume":  # a run without checkpoints is no reason to --resume
    assert "--resume" not in err, err
  assert not workdir.exists(), "a run directory was written"
