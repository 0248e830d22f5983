import shlex

import pytest

from jaxrl_hex import cli
from jaxrl_hex.cluster.launch import tpu_hosts


@pytest.mark.parametrize("accelerator, hosts", [("v5p-32", 4), ("v4-8", 1), ("v4-32", 4), ("v5litepod-16", 4),
                                                ("v5litepod-8", 1), ("v6e-8", 1), ("v6e-64", 16)])
def test_hosts_of_a_slice(accelerator, hosts):
  assert tpu_hosts(accelerator) == hosts


def test_launch_tpu_dry_run_prints_one_command_per_worker(capsys):
  code = cli.main([
      "launch", "tpu", "--name", "rl", "--zone", "us-east5-a", "--accelerator-type", "v5p-32", "--project", "p1",
      "--dry-run", "--", "train", "--config.train.steps=10"
  ])
  assert code == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 4
  for worker, line in enumerate(lines):
    argv = shlex.split(line)
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rl"]
    assert "--zone=us-east5-a" in argv and "--project=p1" in argv and f"--worker={worker}" in argv
    remote = next(a for a in argv if a.startswith("--command="))
    assert remote == "--command=cd ~/jaxrl_hex && JAXRL_HEX_MULTIHOST=1 jaxrl-hex train --config.train.steps=10"


def test_launch_ray_dry_run_and_bad_input(capsys):
  assert cli.main([
      "launch", "ray", "--address", "http://127.0.0.1:8265", "--dry-run", "--", "train", "--config.cluster.backend=ray"
  ]) == 0
  assert shlex.split(capsys.readouterr().out.strip()) == [
      "ray", "job", "submit", "--address=http://127.0.0.1:8265", "--working-dir=.", "--", "jaxrl-hex", "train",
      "--config.cluster.backend=ray"
  ]
  assert cli.main(
      ["launch", "tpu", "--name", "x", "--zone", "z", "--accelerator-type", "a100-8", "--dry-run", "--", "train"]) == 2
  assert "--accelerator-type 'a100-8'" in capsys.readouterr().err
  assert cli.main(["launch", "tpu", "--name", "x"]) == 2
  assert "launch needs `-- COMMAND`" in capsys.readouterr().err
