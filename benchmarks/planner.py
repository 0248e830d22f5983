"""Planner benchmark: planning time at 64 devices, optimality vs exhaustive search, the AReaL-Hex
setting, and (given measured-run JSON) calibration with prediction error.

  python benchmarks/planner.py [--measured runs/*.json] [--overlay-out cpu-calibrated.yaml]
                               [--out benchmarks/out/planner.json]
"""
import argparse
import json
import pathlib
import sys
import time

import yaml

from jaxrl_hex.planner import allocate as al, calibrate as cal, cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.planner.model_files import REPO, load_model

LARGE = {"H100": 24, "H20": 24, "L4": 16}  # 64 devices of 3 types
SMALL_WORKLOAD = cm.Workload(batch_size=8, group_size=4, prompt_len=512, output_mean=2048, output_max=8192)
SMALL = [("qwen2_1_5b", {
    "H800": 4,
    "H20": 4
}), ("qwen2_7b", {
    "v5e": 4,
    "v6e": 4
}), ("qwen2_7b", {
    "A100": 5,
    "H20": 3
}), ("qwen2_1_5b", {
    "v5p": 2,
    "H100": 6
}), ("qwen2_1_5b", {
    "L4": 6,
    "H200": 2
}), ("qwen2_7b", {
    "H100": 3,
    "L4": 5
})]


def summary(p):
  return {
      "gen_tokens_per_s": round(p.gen_tokens_per_s, 1),
      "price_per_hour": round(p.price_per_hour, 3),
      "usd_per_mtok": round(p.usd_per_mtok, 5),
      "train": f"{p.train.layout.devices} x {p.train.device_type}",
      "rollout": [f"{g.count} x tp{g.option.replica.tensor} {g.option.replica.device_type}" for g in p.groups]
  }


def timed(fn, *args):
  start = time.perf_counter()
  out = fn(*args)
  return out, time.perf_counter() - start


def bench_large(catalog):
  cfg = load_model("qwen2_7b")[1]
  cluster = al.Cluster(LARGE, catalog, cm.Workload())
  fast, t_fast = timed(al.plan, cfg, cluster, "throughput")
  floor = 0.5 * fast.gen_tokens_per_s
  cheap, t_cheap = timed(al.plan, cfg, cluster, "cost", floor)
  return {
      "cluster": LARGE,
      "model": "qwen2_7b",
      "throughput": dict(summary(fast), seconds=round(t_fast, 2)),
      "cost_with_floor": dict(summary(cheap), seconds=round(t_cheap, 2), min_throughput=round(floor, 1))
  }


def bench_exhaustive(catalog):
  rows = []
  for model, counts in SMALL:
    cfg = load_model(model)[1]
    cluster = al.Cluster(counts, catalog, SMALL_WORKLOAD)
    for objective in al.OBJECTIVES:
      got, t_plan = timed(al.plan, cfg, cluster, objective)
      ref, t_ref = timed(al.exhaustive_plan, cfg, cluster, objective)
      key = "gen_tokens_per_s" if objective == "throughput" else "usd_per_mtok"
      a, b = getattr(got, key), getattr(ref, key)
      rows.append({
          "model": model,
          "cluster": counts,
          "objective": objective,
          "planner": round(a, 5),
          "exhaustive": round(b, 5),
          "match": abs(a - b) <= 1e-3 * abs(b),
          "planner_s": round(t_plan, 3),
          "exhaustive_s": round(t_ref, 3)
      })
  return rows


def bench_areal():
  rows = {}
  for model in ("qwen2_1_5b", "qwen2_7b", "qwen2_14b"):
    cfg = load_model(model)[1]
    plans = {
        name: al.plan(cfg, al.load_cluster(REPO / f"meshes/cluster-areal-{name}.yaml"))
        for name in ("hex", "h800", "h20")
    }
    best_homog = max(plans["h800"].gen_tokens_per_s, plans["h20"].gen_tokens_per_s)
    rows[model] = {
        "24xH800+24xH20": summary(plans["hex"]),
        "32xH800": summary(plans["h800"]),
        "88xH20": summary(plans["h20"]),
        "mix_over_best_homogeneous": round(plans["hex"].gen_tokens_per_s / best_homog, 3)
    }
  return rows


def bench_calibration(paths, catalog, overlay_out):
  overlay, report = cal.calibrate(cal.load_measurements(paths), catalog)
  if overlay_out:
    pathlib.Path(overlay_out).write_text(yaml.safe_dump(overlay, sort_keys=False))
  return {
      "overlay": overlay,
      "records": report,
      "max_error_before": max(r["error_before"] for r in report),
      "max_error_after": max(r["error_after"] for r in report)
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--measured", nargs="*", default=[], help="measured-run JSON files (see planner/calibrate.py)")
  ap.add_argument("--overlay-out", help="write the fitted catalog overlay here (use with --catalog)")
  ap.add_argument("--out", default="benchmarks/out/planner.json")
  args = ap.parse_args(argv)
  catalog = load_catalog()
  result = {"large": bench_large(catalog)}
  print(f"64 devices {LARGE}, qwen2_7b: throughput plan {result['large']['throughput']['seconds']} s, "
        f"cost plan {result['large']['cost_with_floor']['seconds']} s")
  result["exhaustive"] = bench_exhaustive(catalog)
  matched = sum(r["match"] for r in result["exhaustive"])
  print(f"planner == exhaustive optimum on {matched}/{len(result['exhaustive'])} small-cluster cases")
  result["areal_hex"] = bench_areal()
  for model, row in result["areal_hex"].items():
    print(f"AReaL-Hex {model}: mix {row['24xH800+24xH20']['gen_tokens_per_s']:,.0f} tok/s, "
          f"32 H800 {row['32xH800']['gen_tokens_per_s']:,.0f}, 88 H20 {row['88xH20']['gen_tokens_per_s']:,.0f} "
          f"({row['mix_over_best_homogeneous']}x best homogeneous)")
  if args.measured:
    result["calibration"] = bench_calibration(args.measured, catalog, args.overlay_out)
    for r in result["calibration"]["records"]:
      print(f"  {r['pool']:>7} {r['device_type']} {r['mesh']}: measured {r['measured_s'] * 1e3:.2f} ms, predicted "
            f"{r['predicted_after_s'] * 1e3:.2f} ms after calibration ({r['error_after']:.1%}; "
            f"{r['error_before']:.1%} before)")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
