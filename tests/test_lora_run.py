"""A LoRA run (its checkpoints hold adapters only, its base elsewhere): a resume restores adapters and
optimizer exactly and refuses a changed base, and the commands that read its checkpoint work on it: eval
scores what the run recorded, convert --to-hf exports it merged for plain transformers, --to-peft exports
its adapters for peft on the exported base, --from-peft brings them back as a run, and a base that changed
under the run is refused in one line."""
import contextlib
import io
import json
import os
import shlex
import shutil

import numpy as np
import pytest
from hf_support import torch_logits
from support import SMALL, load_config
from test_convert import _engine_greedy, _hf_greedy

from jaxrl_hex import cli, commands
from jaxrl_hex.base_weights import BASE_RECORD
from jaxrl_hex.checkpoint import Checkpointer
from jaxrl_hex.config import read_run_config
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.peft import CONFIG, WEIGHTS
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.safetensors_files import SafetensorsDir
from jaxrl_hex.tasks import load_task

# one worker builds the module's runs (pytest -n 2 --dist loadgroup), not each of them
pytestmark = pytest.mark.xdist_group("lora_run")

STEPS = 3


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, warm_workdir):
  """The LoRA demo config at rank 4, 3 synchronous RL steps (eta = 0) from the shared warm start (its base)
  with a KL term, no warmup and Orbax sync; checkpointed at 2 and 3, evaluated and logprob-probed at the last."""
  workdir = str(tmp_path_factory.mktemp("lora") / "run")
  cfg = load_config(
      "configs/arith_grpo_lora.py",
      **{
          **SMALL,
          "init_from": warm_workdir,
          "model.lora.rank": 4,
          "algo.kl_coef": 0.01,
          "optim.warmup_steps": 0,  # the first update moves the adapters (the warmup's starts at lr 0)
          "train.max_staleness": 0,
          "sync.method": "orbax",
          "train.steps": STEPS,
          "train.eval_every": STEPS,
          "train.checkpoint_every": 2,
          "sync.probe_every": STEPS  # at the start and once the adapters are trained
      })
  commands.train(cfg, workdir)
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == "train"]
  accuracy = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
  record = json.load(open(os.path.join(workdir, "checkpoints", BASE_RECORD)))
  return {"workdir": workdir, "rows": rows, "accuracy": accuracy, "record": record}


@pytest.fixture(scope="module")
def exports(lora_run, tmp_path_factory):
  """{"merged": --to-hf of the LoRA run, "adapter": its --to-peft, "base": the base as --to-peft's
  printed command exports it, "said": what --to-peft printed}."""
  root = tmp_path_factory.mktemp("exports")
  out = {name: str(root / name) for name in ("merged", "adapter")}
  assert cli.main(["convert", f"--to-hf={lora_run['workdir']}", f"--out={out['merged']}"]) == 0
  said = io.StringIO()
  with contextlib.redirect_stdout(said):
    assert cli.main(["convert", f"--to-peft={lora_run['workdir']}", f"--out={out['adapter']}"]) == 0
  out["said"] = said.getvalue()
  command = shlex.split(out["said"].partition("export it with ")[2])
  assert command[:3] == ["jaxrl-hex", "convert", f"--to-hf={os.path.dirname(lora_run['record']['checkpoint'])}"]
  out["base"] = str(root / "base")
  assert cli.main(command[1:] + [f"--out={out['base']}"]) == 0
  return out


@pytest.fixture(scope="module")
def engine_greedy(lora_run, tmp_path_factory):
  """(12 of the task's eval prompts, the LoRA run's greedy continuations of them by `generate`)."""
  cfg = read_run_config(lora_run["workdir"])
  prompts = [r["prompt"] for r in load_task(cfg.task, cfg).eval[:12]]
  return prompts, _engine_greedy(lora_run["workdir"], prompts, tmp_path_factory.mktemp("greedy"))


def _one_line_error(argv, message, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_lora_run_resumes_like_an_uninterrupted_one_and_refuses_another_base(lora_run, tmp_path, capsys):
  """Adapters alone are checkpointed and synced (Orbax), the base is the KL reference (KL exactly 0 at
  the first step), the engine's adapters score as the trainer's, and a resume from checkpoint 2
  restores adapters and optimizer: at eta = 0 its step 3 equals the uninterrupted run's."""
  straight = lora_run["rows"]
  assert [r["step"] for r in straight] == list(range(STEPS + 1)) and "['embed']" in lora_run["record"]["fingerprint"]
  # the checkpoint's params are the adapters; the base stays where the record says
  saved = json.load(open(os.path.join(lora_run["workdir"], "checkpoints", "2", "params", "_METADATA")))
  names = str(saved["tree_metadata"])
  assert "wq_lora" in names and "'embed'" not in names
  assert sorted(os.listdir(os.path.join(lora_run["workdir"], "sync"))) == ["base"] + [f"v{v:08d}" for v in (1, 2, 3)]
  assert straight[1]["kl"] == 0.0 and straight[2]["kl"] > 0
  assert straight[STEPS]["probe_gap"] < 1e-4
  split = str(tmp_path / "split")
  shutil.copytree(lora_run["workdir"], split)
  assert cli.main(["train", f"--workdir={split}", "--resume", "--step=2"]) == 0
  resumed = [r for r in read_jsonl(os.path.join(split, "metrics.jsonl")) if r["phase"] == "train"]
  assert [r["step"] for r in resumed] == list(range(STEPS + 1)) and resumed[STEPS]["resumed_from"] == 2
  assert resumed[STEPS]["loss"] == pytest.approx(straight[STEPS]["loss"], abs=1e-6)
  assert resumed[STEPS]["grad_norm"] == pytest.approx(straight[STEPS]["grad_norm"], rel=1e-4)
  # a base that is no longer the one the adapters were trained on: one line, nothing trained
  path = os.path.join(split, "checkpoints", BASE_RECORD)
  record = json.load(open(path))
  record["fingerprint"]["['embed']"][0] += 1.0
  with open(path, "w") as f:
    json.dump(record, f)
  capsys.readouterr()
  _one_line_error(["train", f"--workdir={split}", "--resume", "--config.train.steps=4"],
                  "is not the one this run's adapters were trained on (leaf ['embed'] differs from its fingerprint in "
                  "lora_base.json)", capsys)


def test_eval_scores_a_lora_checkpoint_as_the_run_recorded(lora_run, warm_workdir, tmp_path):
  workdir, record = lora_run["workdir"], lora_run["record"]
  assert record["checkpoint"] == os.path.join(warm_workdir, "checkpoints")  # the base: the warm start's weights
  assert Checkpointer(record["checkpoint"]).steps() == [record["step"]]
  out = tmp_path / "eval.json"
  assert cli.main(["eval", f"--workdir={workdir}", f"--out={out}"]) == 0
  result = json.loads(out.read_text())
  assert (result["step"], result["policy_version"], result["records"]) == (STEPS, STEPS, 64)
  assert result["greedy_accuracy"] == lora_run["accuracy"][STEPS]


def test_to_hf_exports_the_merged_model_transformers_continues_as_the_engine(exports, engine_greedy):
  import transformers
  merged, base = SafetensorsDir(exports["merged"]), SafetensorsDir(exports["base"])
  assert sorted(merged.entries) == sorted(base.entries)  # plain weights: no adapter tensor left
  name = "model.layers.0.self_attn.q_proj.weight"
  whole = lambda ckpt: ckpt.read(name, (slice(None), slice(None)))
  assert np.abs(whole(merged) - whole(base)).max() > 1e-4  # the adapters are in it
  prompts, engine = engine_greedy
  tok = transformers.AutoTokenizer.from_pretrained(exports["merged"])
  model = transformers.AutoModelForCausalLM.from_pretrained(exports["merged"])
  assert [_hf_greedy(model, tok(p).input_ids, tok) for p in prompts] == engine
  assert sum(t.isdigit() for t in engine) >= 6


def test_to_peft_adapters_on_the_exported_base_give_the_merged_model_s_logits(lora_run, exports):
  import peft
  import transformers
  config = json.load(open(os.path.join(exports["adapter"], CONFIG)))
  assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 32, None)  # no model_dir
  assert f"step {lora_run['record']['step']} of the run" in exports["said"]
  tok = transformers.AutoTokenizer.from_pretrained(exports["merged"])
  ids = np.array([tok(p).input_ids for p in ("12+30=", "97+45=")])
  base = transformers.AutoModelForCausalLM.from_pretrained(exports["base"])
  base_logits = torch_logits(base, ids)
  theirs = torch_logits(peft.PeftModel.from_pretrained(base, exports["adapter"]).eval(), ids)
  merged = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(exports["merged"]), ids)
  assert np.abs(theirs - merged).max() <= 1e-4 * np.abs(merged).max()
  assert np.abs(theirs - base_logits).max() > 1e-3  # what the adapters add shows


def test_from_peft_brings_the_adapters_back_as_a_run_on_their_base(exports, engine_greedy, tmp_path, capsys):
  run = str(tmp_path / "run")
  assert cli.main(["convert", f"--from-peft={exports['adapter']}", f"--base={exports['base']}", f"--out={run}"]) == 0
  assert "as a LoRA run's checkpoint 0" in capsys.readouterr().out
  cfg = read_run_config(run)
  assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model_dir) == (4, 32.0, exports["base"])
  assert json.load(open(os.path.join(run, "checkpoints", BASE_RECORD)))["model_dir"] == exports["base"]
  # the adapters on the base its record names: the LoRA run's model, continuing prompts as it does
  prompts, engine = engine_greedy
  assert _engine_greedy(run, prompts, tmp_path) == engine
  again = str(tmp_path / "adapter")  # and back out: the same adapter, now naming its base
  assert cli.main(["convert", f"--to-peft={run}", f"--out={again}"]) == 0
  assert json.load(open(os.path.join(again, CONFIG)))["base_model_name_or_path"] == exports["base"]
  ours, before = SafetensorsDir(again, WEIGHTS), SafetensorsDir(exports["adapter"], WEIGHTS)
  assert sorted(ours.entries) == sorted(before.entries)
  for name, entry in before.entries.items():
    index = tuple(slice(None) for _ in entry.shape)
    np.testing.assert_array_equal(ours.read(name, index), before.read(name, index))


def test_a_run_whose_base_changed_is_refused_in_one_line(lora_run, tmp_path, capsys):
  workdir, other = str(tmp_path / "run"), str(tmp_path / "other")
  shutil.copytree(lora_run["workdir"], workdir)
  record = lora_run["record"]  # the copy's base now lies elsewhere, and is other weights
  base = Policy.build(model_config(**read_run_config(workdir).model)).base()
  saver = Checkpointer(other)
  saver.save(record["step"], {"params": base.init(1)}, {})
  saver.close()
  with open(os.path.join(workdir, "checkpoints", BASE_RECORD), "w") as f:
    json.dump(dict(record, checkpoint=other), f)
  changed = "is not the one this run's adapters were trained on"
  _one_line_error(["convert", f"--to-hf={workdir}", f"--out={tmp_path / 'hf'}"], changed, capsys)
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "12+30="}\n')
  _one_line_error(["generate", f"--workdir={workdir}", f"--prompts={prompts}", f"--out={tmp_path / 'o.jsonl'}"],
                  f"--workdir: the LoRA base (checkpoint {record['step']} of {other}) {changed}", capsys)
