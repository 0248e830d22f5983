"""Where `jaxrl-hex plan` writes, and that the committed meshes/plan-*.yaml are its output: the
command on each file's first line writes the same file again."""
import glob
import os
import shlex

import pytest
from support import ROOT

from jaxrl_hex.planner.command import plan_main

PLANS = sorted(glob.glob(os.path.join(ROOT, "meshes", "plan-*.yaml")))


def test_plan_writes_into_the_current_directory_never_beside_the_cluster_file(tmp_path, monkeypatch, capsys):
  inputs, here = tmp_path / "inputs", tmp_path / "here"
  inputs.mkdir()
  here.mkdir()
  (inputs / "cluster-small.yaml").write_text("cluster:\n  - {type: cpu, count: 8}\n")
  monkeypatch.chdir(here)
  assert plan_main(["--cluster", str(inputs / "cluster-small.yaml"), "--model", "tiny"]) == 0
  assert os.listdir(inputs) == ["cluster-small.yaml"] and os.listdir(here) == ["plan-small-tiny.yaml"]
  assert capsys.readouterr().out.strip().endswith("wrote plan-small-tiny.yaml")
  first = (here / "plan-small-tiny.yaml").read_text().splitlines()[0]
  assert first.endswith("--objective throughput --out plan-small-tiny.yaml`.")  # the command that wrote it


@pytest.mark.parametrize("path", PLANS, ids=os.path.basename)
def test_committed_plan_is_what_its_first_line_writes(path, tmp_path, monkeypatch, capsys):
  text = open(path).read()
  header, body = text.split("\n", 1)
  assert header.startswith("# Written by `jaxrl-hex plan ") and header.endswith("`."), header
  argv = shlex.split(header[len("# Written by `"):-len("`.")])[2:]
  if "--out" in argv:  # the file's own path, relative to the repository root
    i = argv.index("--out")
    assert argv[i + 1] == os.path.relpath(path, ROOT), header
    del argv[i:i + 2]
  monkeypatch.chdir(ROOT)  # the header's paths are the repository's
  out = tmp_path / "plan.yaml"
  assert plan_main(argv + ["--out", str(out)]) == 0
  capsys.readouterr()
  assert out.read_text().split("\n", 1)[1] == body, f"{path} is stale: run the command on its first line"
