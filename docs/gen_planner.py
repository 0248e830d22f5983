"""Writes the example plans' figures in docs/planner.md from the planner itself, so the figures the
page quotes are the ones `jaxrl-hex plan` prints. Run after changing the cost model, the catalog or
a cluster file:

  python docs/gen_planner.py          # rewrites the table between the markers in docs/planner.md
  python docs/gen_planner.py --check  # exit 1 if it is out of date (tests/planner/test_fidelity.py)
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "planner.md")
BEGIN = "<!-- plan figures: written by `python docs/gen_planner.py`; do not edit by hand -->"
END = "<!-- end of plan figures -->"
# (cluster file, model): the examples the page discusses, with the cluster files' own workloads
EXAMPLES = (("meshes/cluster-areal-hex.yaml", "qwen2_1_5b"), ("meshes/cluster-areal-hex.yaml", "qwen2_7b"),
            ("meshes/cluster-areal-hex.yaml", "qwen2_14b"), ("meshes/cluster-v5p-h100.yaml",
                                                             "qwen2_7b"), ("meshes/cluster-v5e-v6e.yaml", "qwen2_7b"))


def _row(cluster_file, model) -> str:
  from jaxrl_hex.planner import PlanError
  from jaxrl_hex.planner.command import make_plan
  p, name, cluster, alternatives, _ = make_plan(os.path.join(ROOT, cluster_file), model)
  t = p.train
  mesh = " x ".join(f"{k} {v}" for k, v in t.layout.mesh().items() if v > 1) or "one device"
  knobs = t.knobs(cluster.catalog[t.device_type])
  train = f"{t.layout.devices} {t.device_type}, {mesh}, remat {knobs['remat']}"
  rollout = " + ".join(f"{g.count} x TP {g.option.replica.tensor} {g.option.replica.device_type} "
                       f"({g.assigned // g.count // p.workload.group_size} prompts each)" for g in p.groups)
  idle = ", ".join(f"{n} {k}" for k, n in p.idle.items()) or "none"
  bound = "train" if t.step_s >= p.rollout_s + p.workload.reward_s else "rollout"
  homogeneous = "; ".join(f"{n} {kind}: infeasible" if isinstance(alt, PlanError) else
                          f"{n} {kind}: {alt.gen_tokens_per_s:,.0f} tok/s, ${alt.usd_per_mtok:.3f}/M "
                          f"(plan {p.gen_tokens_per_s / alt.gen_tokens_per_s:.2f}x)"
                          for kind, (n, alt) in alternatives.items())
  have = " + ".join(f"{n} {k}" for k, n in cluster.counts.items())
  return (f"| `{os.path.basename(cluster_file)}` ({have}) | {name} | {train} | {rollout} | {idle} | "
          f"{p.step_s:.1f} s, {bound}-bound | {p.gen_tokens_per_s:,.0f} | ${p.price_per_hour:,.2f} | "
          f"${p.usd_per_mtok:.3f} | {homogeneous} |")


def render() -> str:
  """The table, markers included."""
  lines = [
      BEGIN, "", "| cluster | model | train | rollout replicas | idle | step | generated tok/s | $/hour | $/M tokens "
      "| homogeneous, same budget |", "|---|---|---|---|---|---|---|---|---|---|"
  ]
  lines += [_row(cluster, model) for cluster, model in EXAMPLES]
  return "\n".join(lines + ["", END])


def rewrite(text: str) -> str:
  head, found, rest = text.partition(BEGIN)
  if not found or END not in rest:
    raise SystemExit(f"{DOC} has no `{BEGIN}` ... `{END}` block to rewrite")
  return head + render() + rest.split(END, 1)[1]


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  from generated import write_or_check  # docs/, beside this script
  write_or_check(DOC, rewrite(open(DOC).read()), "python docs/gen_planner.py")
