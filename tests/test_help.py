"""Every subcommand answers --help with its own help (exit 0, nothing on stderr) naming each of its
flags, and docs/cli.md carries that text, not an error, for each."""
import os
import re

import pytest
from support import ROOT

from jaxrl_hex import cli


def _flags_described(text):
  """Flags with a line of their own in the options lists (argparse puts each at the start of one)."""
  return set(re.findall(r"^\s+(--[a-z][\w-]*)", text, re.M))


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_exits_0_and_names_every_flag(name, capsys):
  assert cli.main([name, "--help"]) == 0
  out, err = capsys.readouterr()
  assert err == "" and out.startswith(f"usage: jaxrl-hex {name}"), (out, err)
  described = _flags_described(out) - {"--help"}
  assert described, f"{name} --help names no flag"
  usage = out.split("\n\n", 1)[0]  # argparse's synopsis, up to the first blank line
  in_usage = set(re.findall(r"(--[a-z][\w-]*)", usage)) - {"--help"}
  assert in_usage <= described, (name, in_usage - described)


def test_launch_help_shows_both_targets_flags(capsys):
  assert cli.main(["launch", "--help"]) == 0
  out = capsys.readouterr().out
  assert "-- COMMAND" in out and {"--accelerator-type", "--zone", "--address", "--working-dir"} <= _flags_described(out)


def test_cli_reference_has_help_text_for_every_subcommand():
  text = open(os.path.join(ROOT, "docs", "cli.md")).read()
  for name in cli.COMMANDS:
    if name in ("train", "sft"):  # their flags are a table, with every config field
      assert "`jaxrl-hex {train,sft} [flags]" in text
      continue
    section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
    assert f"usage: jaxrl-hex {name}" in section, (name, section[:300])
    assert "jaxrl-hex: error" not in section and "Traceback" not in section, (name, section[:300])


def test_no_command_lists_the_commands_and_exits_2(capsys):
  assert cli.main([]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("usage: jaxrl-hex COMMAND") and all(f"\n  {n} " in err for n in ("train", "eval"))
  assert cli.main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: jaxrl-hex COMMAND")


@pytest.mark.parametrize("name", ["train", "sft"])
def test_train_and_sft_help_name_the_config_sections_and_the_reference(name, capsys):
  assert cli.main([name, "--help"]) == 0
  out = " ".join(capsys.readouterr().out.split())
  assert "config sections (--config.SECTION.FIELD=VALUE): " in out and "docs/cli.md" in out
  assert all(section in out for section in ("model", "rollout", "algo", "train", "sft", "sync", "cluster"))
