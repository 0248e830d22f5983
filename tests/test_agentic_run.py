"""Agentic RL end to end on the local backend: the calculator tool task warm-started, trained on
whole episodes, its episodes' figures in the metrics and the report, its transcripts from
`jaxrl-hex generate`, and tools that fail without stopping the run."""
import json
import os

import pytest
from support import ROOT
from support_agentic import calculator_config

from jaxrl_hex import cli, commands, report
from jaxrl_hex.metrics import read_jsonl

pytestmark = pytest.mark.xdist_group("agentic")  # the module's run is built once, on one worker
STEPS = 4


@pytest.fixture(scope="module")
def calc_run(calculator_warm, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("calc") / "run")
  commands.train(calculator_config(init_from=calculator_warm, **{"train.steps": STEPS, "train.eval_every": 2}), workdir)
  return workdir


def _rows(workdir):
  return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train" and "loss" in r]


def test_the_tool_task_trains_on_whole_episodes_each_used_once(calc_run):
  rows = _rows(calc_run)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert sorted(r["batch"] for r in rows) == list(range(STEPS))  # every batch trained once, in order
  for r in rows:
    assert len(r["prompt_ids"]) == 8  # prompts_per_step: a batch's records, each a group of episodes
    assert r["episode_turns"] > 1.5 and r["episode_tool_calls"] > 0.5  # the warm start calls the tool
    assert 0.2 < r["env_token_share"] < 0.7 and r["episode_tokens_max"] <= 80
    assert r["advantage_abs_mean"] > 0  # rewards reach the turns (observations lie between them)
  assert {"tool_errors", "episode_faults"} <= set(rows[-1])
  summary = json.load(open(os.path.join(calc_run, "summary.json")))
  assert summary["steps"] == STEPS and summary["eval_accuracy_end"] is not None


def test_generate_plays_episodes_and_writes_their_transcripts(calc_run, tmp_path):
  """The transcripts of the eval episodes: greedy, the same scoring as the run's own evaluation."""
  rows = [r for r in read_jsonl(os.path.join(calc_run, "metrics.jsonl")) if r.get("eval_accuracy") is not None]
  records = tmp_path / "records.jsonl"
  from jaxrl_hex.config import read_run_config
  from jaxrl_hex.tasks import load_task
  cfg = read_run_config(calc_run)
  task = load_task(cfg.task, cfg)
  records.write_text("".join(json.dumps(r) + "\n" for r in list(task.eval)[:cfg.train.eval_size]))
  out = tmp_path / "episodes.jsonl"
  assert cli.main(["generate", f"--workdir={calc_run}", f"--episodes={records}", f"--out={out}", "--greedy"]) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(lines) == cfg.train.eval_size
  assert sum(line["reward"] for line in lines) / len(lines) == pytest.approx(rows[-1]["eval_accuracy"])
  called = [line for line in lines if line["tool_calls"]]
  assert called
  roles = [t["role"] for t in called[0]["transcript"]]
  assert roles[:3] == ["env", "model", "tool"] and roles[-1] == "model"
  assert called[0]["transcript"][2]["text"].startswith("<result>")


def test_the_report_shows_the_episodes(calc_run, tmp_path):
  out = tmp_path / "report"
  report.render([calc_run], str(out))
  assert (out / "episodes.png").stat().st_size > 10_000
  text = (out / "report.md").read_text()
  assert "model turns and" in text and "episodes.png" in text


def test_tools_that_raise_hang_or_return_garbage_are_counted_and_the_run_goes_on(calculator_warm, tmp_path):
  workdir = str(tmp_path / "flaky")
  task = os.path.join(ROOT, "tests", "fixtures", "flaky_calculator.py") + ":make_env"
  commands.train(calculator_config(init_from=calculator_warm, task=task, **{"train.steps": 2}), workdir)
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[-1]["tool_errors"] >= 4  # raised, hung (0.5 s timeout) and returned None: each an error observation
  assert rows[-1]["episode_tool_calls"] > 0.5
