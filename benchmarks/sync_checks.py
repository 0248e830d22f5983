"""What the weight-sync checks (issue 16) cost on the default run: the per-leaf fingerprint (on the
trainer at publish, on the rollout side at receive) and the logprob probe, against the step time.

Two runs of the default config (`jaxrl-hex train`, its model, task, batch and mesh), both from one
short warm start: one with every check on every version (sync.verify_every=1, sync.probe_every=1),
one with none. The fingerprint's cost is the difference of the two runs' median publish and
receive spans; the probe's is its own span; the step period is the unchecked run's median time
between train rows. At the defaults the checks run every sync.verify_every and sync.probe_every
versions, so their share of the step time is each cost over its interval.

  python benchmarks/sync_checks.py    # ~4 min; benchmarks/out/sync_checks.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from readme_section import write_section  # noqa: E402

from jaxrl_hex import cli  # noqa: E402
from jaxrl_hex.config import base_config  # noqa: E402
from jaxrl_hex.metrics import read_jsonl  # noqa: E402


def spans(workdir, pool, kind) -> list:
  return [
      s["end"] - s["start"] for s in read_jsonl(os.path.join(workdir, "spans.jsonl"))
      if s["pool"] == pool and s["kind"] == kind
  ]


def train(workdir, warm, steps, every) -> dict:
  code = cli.main([
      "train", f"--workdir={workdir}", f"--config.init_from={warm}", f"--config.train.steps={steps}",
      "--config.train.eval_every=100000", "--config.train.checkpoint_every=100000",
      f"--config.sync.verify_every={every}", f"--config.sync.probe_every={every}"
  ])
  assert code == 0, f"train exited {code}"
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train"]
  periods = [b["wall_s"] - a["wall_s"] for a, b in zip(rows[2:], rows[3:])]  # past the first steps' compiles
  return {
      "step_s": statistics.median(periods),
      "publish_s": statistics.median(spans(workdir, "train", "sync")[2:]),
      "receive_s": statistics.median(spans(workdir, "rollout", "sync")[2:] or [0.0]),
      "probe_s": statistics.median(spans(workdir, "train", "probe")[2:] or [0.0]),
      "probe_gap_max": max((r["probe_gap"] for r in rows if r.get("probe_gap") is not None), default=None),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--out", default=os.path.join(HERE, "out", "sync_checks.json"))
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    warm = os.path.join(tmp, "warm")
    assert cli.main(["sft", f"--workdir={warm}", "--config.sft.max_steps=20"]) == 0
    checked = train(os.path.join(tmp, "checked"), warm, args.steps, 1)
    plain = train(os.path.join(tmp, "plain"), warm, args.steps, 0)
  sync = base_config().sync
  fingerprint_s = max(checked["publish_s"] - plain["publish_s"], 0.0) + max(checked["receive_s"] - plain["receive_s"],
                                                                            0.0)
  share_fingerprint = fingerprint_s / sync.verify_every / plain["step_s"]
  share_probe = checked["probe_s"] / sync.probe_every / plain["step_s"]
  out = {
      "checked": checked,
      "plain": plain,
      "fingerprint_s": fingerprint_s,
      "verify_every": sync.verify_every,
      "probe_every": sync.probe_every,
      "share_fingerprint": share_fingerprint,
      "share_probe": share_probe,
      "share_total": share_fingerprint + share_probe
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  ms = lambda s: f"{1e3 * s:.1f} ms"
  text = "\n".join([
      "| check | cost per check | interval (default) | share of the step time |", "|---|---|---|---|",
      f"| fingerprint (publish + receive) | {ms(fingerprint_s)} | {sync.verify_every} versions | "
      f"{100 * share_fingerprint:.2f}% |",
      f"| logprob probe | {ms(checked['probe_s'])} | {sync.probe_every} versions | {100 * share_probe:.2f}% |",
      f"| both | | | **{100 * (share_fingerprint + share_probe):.2f}%** (goal <= 2%) |", "",
      f"Step period of the unchecked run: {ms(plain['step_s'])}; the largest probe gap over "
      f"{args.steps} probes: {checked['probe_gap_max']:.2g} nats (tolerance {sync.probe_tolerance:g})."
  ])
  write_section("sync_checks", text, "Weight-sync checks on the default run (benchmarks/sync_checks.py, issue 16)")
  print(text)


if __name__ == "__main__":
  main()
