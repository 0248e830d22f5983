"""`jaxrl-hex plan` and `jaxrl-hex simulate`: argument parsing, plan files and readable output."""
import dataclasses
import json
import pathlib
import shlex

import yaml

from jaxrl_hex import arguments
from jaxrl_hex.planner import PlanError, allocate, cost_model as cm
from jaxrl_hex.planner.model_files import load_model, with_lora
from jaxrl_hex.planner.simulate import SimSpec, draw_timeline, simulate


def one_rollout_runtime(p: allocate.Plan, cluster: allocate.Cluster) -> bool:
  """Whether the rollout side is one mesh {data: replicas, tensor: T} (what the local backend runs):
  one replica configuration, the same prompts on every replica, inside one host."""
  if len(p.groups) != 1:
    return False
  g = p.groups[0]
  r = g.option.replica
  return g.count * r.tensor <= cluster.catalog[r.device_type].chips_per_host


def _pool_hosts(kind, devices, cluster) -> dict:
  """processes / hosts / ray fields of a pool that spans hosts (one runtime over several machines):
  a GPU pool runs a process per GPU, a TPU slice a process per host."""
  dev = cluster.catalog[kind]
  if dev.platform == "cpu" or devices <= dev.chips_per_host:
    return {}
  hosts = devices // dev.chips_per_host
  if dev.platform == "gpu":
    return {"processes": devices, "hosts": hosts, "ray": {"num_gpus": 1}}
  return {"processes": hosts, "hosts": hosts, "ray": {"resources": {"TPU": dev.chips_per_host}}}


def _pinned(cluster, kind, replicas=None) -> dict:
  """The `affinity` of a pool (or of each of a group's `replicas`) of a cpu type the cluster file
  pins to cores: the speeds the planner assumed are those cores' shares."""
  cores = cluster.cores.get(kind)
  if not cores:
    return {}
  return {"affinity": list(cores) if replicas is None else [list(cores) for _ in range(replicas)]}


def plan_to_mesh(p: allocate.Plan, model_name, cluster: allocate.Cluster, alternatives=None) -> dict:
  """The runtime's mesh-file format (pools.train / pools.rollout) plus a `plan:` block.

  The rollout side is one mesh when one_rollout_runtime holds; otherwise it is `replicas:`, one
  entry per group of replicas that share a layout and a share of the batch (each replica its own
  runtime, on the Ray backend). Every group carries `share`: each replica's fraction of a step's
  sequences, whole prompts (sum over the fleet of count x share = 1).
  """
  t, w = p.train, p.workload
  groups = p.groups
  rollout_types = {g.option.replica.device_type for g in groups}
  tensors = {g.option.replica.tensor for g in groups}
  rollout = {
      "device_type": next(iter(rollout_types)) if len(rollout_types) == 1 else "mixed",
      "devices": sum(p.rollout_devices.values()),
      # With replica groups the mesh gives the replica count and largest TP degree;
      # `replicas` is the authoritative per-group layout.
      "mesh": {
          "data": sum(g.count for g in groups),
          "tensor": max(tensors)
      }
  }
  if one_rollout_runtime(p, cluster):
    rollout.update(_pinned(cluster, next(iter(rollout_types))))
  else:
    rollout["replicas"] = [{
        "device_type": g.option.replica.device_type,
        "count": g.count,
        "mesh": {
            "tensor": g.option.replica.tensor
        },
        "share": g.share(w.sequences),
        **_pinned(cluster, g.option.replica.device_type, g.count)
    } for g in groups]
  used = [t.device_type] + [g.option.replica.device_type for g in groups]
  platforms = {cluster.catalog[k].platform for k in used}
  out = {"platform": platforms.pop() if len(platforms) == 1 else "mixed"}
  if out["platform"] == "cpu":
    out["num_devices"] = t.layout.devices + rollout["devices"]
  out["pools"] = {
      "train": {
          "device_type": t.device_type,
          "devices": t.layout.devices,
          "mesh": t.layout.mesh(),
          **({
              "rules": t.layout.rules()
          } if t.layout.rules() else {}),
          **_pool_hosts(t.device_type, t.layout.devices, cluster),
          **_pinned(cluster, t.device_type)
      },
      "rollout": rollout
  }
  out["plan"] = {
      "objective": p.objective,
      "model": model_name,
      "cluster": dict(cluster.counts),
      "predicted": {
          "gen_tokens_per_s": round(p.gen_tokens_per_s, 1),
          "trained_tokens_per_s": round(w.trained_tokens / p.step_s, 1),
          "step_s": round(p.step_s, 4),
          "train_step_s": round(t.step_s, 4),
          "rollout_s": round(p.rollout_s, 4),
          "reward_s": w.reward_s,
          "price_per_hour": round(p.price_per_hour, 4),
          "usd_per_mtok": round(p.usd_per_mtok, 5),
          "train_flop_share": round(p.train_flop_share, 4)
      },
      "idle": dict(p.idle),
      "train": t.knobs(cluster.catalog[t.device_type]),
      "workload": dataclasses.asdict(w),
      "sim": {
          "train_fixed_s": t.fixed_s + t.send_s,
          "train_per_token_s": (t.time.total_s - t.fixed_s) / w.trained_tokens,
          "replicas": [{
              "device_type": g.option.replica.device_type,
              "count": g.count,
              "tensor": g.option.replica.tensor,
              "slots": g.option.replica.slots,
              "step_fixed_s": g.option.replica.step_fixed_s,
              "step_per_seq_s": g.option.replica.step_per_seq_s,
              "prefill_s": g.option.replica.prefill.total_s,
              "recv_s": g.option.recv_s,
              "overhead_s": g.option.overhead_s,
              "tokens_per_s": round(g.option.replica.tokens_per_s(w), 1),
              "assigned": g.assigned,
              "share": g.share(w.sequences)
          } for g in groups]
      }
  }
  if alternatives:
    out["plan"]["alternatives"] = {
        kind: ({
            "count": n,
            "error": str(alt)
        } if isinstance(alt, PlanError) else {
            "count": n,
            "gen_tokens_per_s": round(alt.gen_tokens_per_s, 1),
            "price_per_hour": round(alt.price_per_hour, 4),
            "usd_per_mtok": round(alt.usd_per_mtok, 5)
        }) for kind, (n, alt) in alternatives.items()
    }
  return out


def format_plan(p: allocate.Plan, model_name, cluster, alternatives, budget) -> str:
  t, w = p.train, p.workload
  have = " + ".join(f"{n} {k}" for k, n in cluster.counts.items())
  mesh = " ".join(f"{k}={v}" for k, v in t.layout.mesh().items())
  lora = f", LoRA rank {t.lora['rank']} on {len(t.lora['targets'])} projections ({t.lora['serving']})" if t.lora else ""
  lines = [
      f"Plan for {model_name}{lora} on {have} (objective: {p.objective})",
      f"  train    {t.layout.devices} x {t.device_type}, mesh {mesh}: step {t.time.total_s:.2f} s "
      f"(roofline {t.time.roofline_s / t.time.efficiency:.2f} s at MFU {t.time.efficiency:.0%}, "
      f"comm {t.time.comm_s:.2f} s) + {'adapter' if t.lora else 'weight'} push {t.send_s:.2f} s, "
      f"{t.memory_bytes / 1e9:.1f} GB per chip"
  ]
  for g in p.groups:
    r = g.option.replica
    lines.append(f"  rollout  {g.count} replica(s) x {r.tensor} {r.device_type} (TP {r.tensor}): {r.slots} slots, "
                 f"{r.tokens_per_s(w):,.0f} tok/s each when full, {g.assigned // g.count // w.group_size} prompts each "
                 f"({g.assigned} of {w.sequences} sequences/step), weight receive {g.option.recv_s:.2f} s")
  if p.idle:
    lines.append("  idle     " + ", ".join(f"{n} x {k}" for k, n in p.idle.items()))
  bound = "train" if t.step_s >= p.rollout_s + w.reward_s else "rollout"
  lines += [
      f"  step     {p.step_s:.2f} s ({bound}-bound; train {t.step_s:.2f} s, rollout {p.rollout_s:.2f} s "
      f"+ reward {w.reward_s:g} s; eta {w.eta})",
      f"  predict  {p.gen_tokens_per_s:,.0f} generated tok/s, {w.trained_tokens / p.step_s:,.0f} trained tok/s",
      f"  cost     ${p.price_per_hour:,.2f}/hour, ${p.usd_per_mtok:.3f} per M generated tokens; "
      f"training gets {p.train_flop_share:.0%} of the cluster's FLOPs",
      f"Homogeneous alternatives at the whole cluster's budget (${budget:,.2f}/hour):"
  ]
  for kind, (n, alt) in alternatives.items():
    if isinstance(alt, PlanError):
      lines.append(f"  {n:>4} x {kind}: infeasible ({alt})")
    else:
      lines.append(f"  {n:>4} x {kind}: {alt.gen_tokens_per_s:,.0f} tok/s, ${alt.price_per_hour:,.2f}/hour, "
                   f"${alt.usd_per_mtok:.3f}/M -> this plan is {p.gen_tokens_per_s / alt.gen_tokens_per_s:.2f}x "
                   f"the throughput")
  return "\n".join(lines)


def plan_main(argv) -> int:
  return arguments.run(_plan_parser(), _plan, argv)


def simulate_main(argv) -> int:
  return arguments.run(_simulate_parser(), _simulate, argv)


def _plan_parser():
  ap = arguments.Parser("jaxrl-hex plan", "Split a mixed TPU/GPU cluster into training and rollout pools.")
  ap.add_argument("--cluster", required=True, help="meshes/cluster-NAME.yaml")
  ap.add_argument("--model", required=True, help="configs/models/NAME.py or NAME")
  ap.add_argument("--objective", choices=allocate.OBJECTIVES, default="throughput")
  ap.add_argument("--min-throughput", type=float, default=0.0, help="generated tokens/s floor (for --objective cost)")
  ap.add_argument("--catalog", help="extra catalog YAML: overrides or adds device entries")
  ap.add_argument(
      "--lora-rank", type=int, help="train LoRA adapters of this rank on the model file's "
      "model.lora.targets (frozen base: less memory, adapter-only syncs); 0: full fine-tuning "
      "(default: the model file's model.lora.rank)")
  ap.add_argument(
      "--lora-serving", choices=cm.LORA_SERVING, default="unmerged",
      help="with LoRA, how rollout replicas apply the adapters, as the run's rollout.lora_serving: "
      "beside the base, or merged into a copy of the targeted weights (more memory)")
  ap.add_argument("--out", help="plan mesh file to write (default: plan-CLUSTER-MODEL[-loraR].yaml in the current "
                  "directory)")
  ap.add_argument("--json", action="store_true", help="print the plan file as JSON instead of text")
  return ap


def make_plan(cluster_file, model, objective="throughput", min_throughput=0.0, catalog=None, lora_rank=None,
              lora_serving="unmerged"):
  """What `plan` prints and writes: (plan, model name, cluster, homogeneous alternatives, budget).
  lora_rank: model.lora.rank to plan for (None: the model file's); lora_serving: rollout.lora_serving."""
  model_name, cfg = load_model(model)
  if lora_rank is not None:
    cfg = with_lora(cfg, lora_rank)
  cluster = allocate.load_cluster(cluster_file, catalog)
  p = allocate.plan(cfg, cluster, objective, min_throughput, model_name, lora_serving)
  budget = sum(cluster.catalog[k].price_per_hour * n for k, n in cluster.counts.items())
  alternatives = allocate.homogeneous_alternatives(cfg, cluster, budget, objective, min_throughput, model_name,
                                                   lora_serving)
  return p, model_name, cluster, alternatives, budget


def _plan(args):
  p, model_name, cluster, alternatives, budget = make_plan(args.cluster, args.model, args.objective,
                                                           args.min_throughput, args.catalog, args.lora_rank,
                                                           args.lora_serving)
  mesh = plan_to_mesh(p, model_name, cluster, alternatives)
  # the current directory, never beside the cluster file: that may be a checkout's meshes/ or read-only
  lora = f"-lora{p.train.lora['rank']}" if p.train.lora else ""
  out = pathlib.Path(args.out or
                     f"plan-{pathlib.Path(args.cluster).stem.removeprefix('cluster-')}-{model_name}{lora}.yaml")
  command = ["jaxrl-hex", "plan", "--cluster", args.cluster, "--model", args.model, "--objective", args.objective]
  command += ["--min-throughput", f"{args.min_throughput:g}"] if args.min_throughput else []
  command += ["--catalog", args.catalog] if args.catalog else []
  command += ["--lora-rank", str(args.lora_rank)] if args.lora_rank is not None else []
  command += ["--lora-serving", args.lora_serving] if args.lora_serving != "unmerged" else []
  out.write_text(f"# Written by `{shlex.join(command + ['--out', str(out)])}`.\n" +
                 yaml.safe_dump(mesh, sort_keys=False))
  if args.json:
    print(json.dumps(mesh, indent=1))
  else:
    print(format_plan(p, model_name, cluster, alternatives, budget))
    print(f"wrote {out}")
  return 0


def _simulate_parser():
  ap = arguments.Parser("jaxrl-hex simulate", "Run a plan through the discrete-event simulator of the async loop.")
  ap.add_argument("--plan", required=True, help="plan mesh file written by `jaxrl-hex plan`")
  ap.add_argument("--out", default="timeline.png", help="timeline PNG to write")
  ap.add_argument("--steps", type=int, default=20, help="trainer steps to simulate")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", action="store_true", help="print the results as JSON")
  return ap


def _simulate(args):
  try:
    data = yaml.safe_load(pathlib.Path(args.plan).read_text())
  except FileNotFoundError:
    raise PlanError(f"plan file {args.plan} not found; write one with `jaxrl-hex plan --out`") from None
  spec = SimSpec.from_plan_file(data or {}, args.plan)
  if args.steps < 2:
    raise PlanError("--steps must be at least 2 (the first step is warm-up)")
  result = simulate(spec, args.steps, args.seed)
  predicted = data["plan"].get("predicted", {}).get("gen_tokens_per_s")
  draw_timeline(result, spec, args.out, title=f"{data['plan'].get('model', '')}:")
  summary = dict(result.summary(), predicted_gen_tokens_per_s=predicted, timeline=args.out)
  if args.json:
    print(json.dumps(summary, indent=1))
  else:
    print(f"simulated {result.steps} steps in {result.duration_s:,.1f} s: {result.gen_tokens_per_s:,.0f} generated "
          f"tok/s (planner predicted {predicted:,.0f})")
    print(f"  trainer idle {result.trainer_idle_frac:.1%}; rollout idle {result.rollout_idle_frac:.1%}, "
          f"slot use {result.rollout_slot_util:.1%}, weight-sync pauses {result.sync_frac:.1%}")
    print("  staleness " + ", ".join(f"{k}: {v}" for k, v in result.staleness.items()))
    print(f"wrote {args.out}")
  return 0
