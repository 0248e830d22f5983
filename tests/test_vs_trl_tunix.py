"""benchmarks/vs_trl_tunix.py's bookkeeping: TRL is handed prompt texts that its tokenizer turns into
the engine's token ids, and our side's step times leave out the steps whose rows hold an evaluation."""
import json
import os
import sys

import pytest
from hf_support import save_tokenizer
from support import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import vs_trl_tunix as vs  # noqa: E402  (benchmarks/ is no package)

TEXTS = ["What is 12 + 7? You are a helpful AI assistant system user assistant 0123456789"] * 20


def job(model_dir, steps=3, eval_every=3):
  return vs.resolve_job(vs.RECIPE, [["model_dir", str(model_dir)]], steps, eval_every, eval_size=4)


@pytest.mark.parametrize("bos", [False, True], ids=["template-without-bos", "template-writes-bos"])
def test_trl_tokenizes_its_prompt_text_to_the_engines_ids(tmp_path, bos):
  import transformers
  save_tokenizer(str(tmp_path), TEXTS, bos=bos)
  j = job(tmp_path)
  assert (len(j.train), len(j.eval)) == (3 * j.prompts_per_step, 4)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for p in j.train + j.eval:
    assert p.ids[0] == j.bos_id and p.ids[1] != j.bos_id
    assert tokenizer(vs.trl_text(tokenizer, j, p))["input_ids"] == p.ids


def write_run(workdir, j, prompt_ids):
  """A run's metrics and spans: evaluations at steps 0 and 3, steps 10 s apart plus 5 s for the evaluation."""
  os.makedirs(workdir)
  rows = [{"phase": "train", "step": 0, "eval_accuracy": 0.25, "wall_s": 100.0}]
  for k in (1, 2, 3):
    rows.append({
        "phase": "train",
        "step": k,
        "batch": k - 1,
        "prompt_ids": prompt_ids[k - 1],
        "rollout_tokens_per_s": 50.0,
        "train_seconds": 6.0,
        "wall_s": 100.0 + 10 * k + (5 if k == 3 else 0),
        **({
            "eval_accuracy": 0.5
        } if k == 3 else {})
    })
  spans = [{"pool": "rollout", "kind": "generate", "start": 0.0, "end": 2.0 + b, "batch": b} for b in range(3)]
  for name, lines in (("metrics.jsonl", rows), ("spans.jsonl", spans)):
    with open(os.path.join(workdir, name), "w") as f:
      f.writelines(json.dumps(x) + "\n" for x in lines)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"train": {"max_staleness": 0}, "algo": {"share_prompts": False}, "mesh_file": "m.yaml"}, f)


def test_our_step_times_leave_out_the_evaluating_steps(tmp_path):
  save_tokenizer(str(tmp_path / "tok"), TEXTS)
  j = job(tmp_path / "tok")
  n = j.prompts_per_step
  write_run(str(tmp_path / "run"), j, [j.train_index[k * n:(k + 1) * n][::-1] for k in range(3)])
  res = vs.ours_result(j, str(tmp_path / "run"))
  assert res.curve == [[0, 0.25], [3, 0.5]]
  assert [(s.step, s.seconds, s.gen_seconds, s.gen_tokens) for s in res.steps] == [(1, 10.0, 2.0, 100),
                                                                                   (2, 10.0, 3.0, 150)]
  prompts = sum(len(p.ids) for p in j.step_prompts(1))
  assert res.steps[1].train_tokens == prompts * j.group_size + 150
  assert res.summary()["step_s"] == 10.0 and res.summary()["train_tokens_per_s"] == res.steps[1].train_tokens / 6.0


def test_a_run_that_drew_other_prompts_is_refused(tmp_path):
  save_tokenizer(str(tmp_path / "tok"), TEXTS)
  j = job(tmp_path / "tok")
  others = sorted(set(range(300)) - set(j.train_index))[:j.prompts_per_step]
  write_run(str(tmp_path / "run"), j, [others] * 3)
  with pytest.raises(vs.BenchError, match="step 1 trained prompts"):
    vs.ours_result(j, str(tmp_path / "run"))
