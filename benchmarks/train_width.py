"""W3's train step at growing model widths: ours / its matmul-rate limit, each measured in one run.

The W3 model (d_model 256, benchmarks/train_vs_tunix.py) and wider ones of the same shape (mlp 4 x
d_model, heads of 64, two queries per KV head, 4 layers), one GRPO AdamW step each, timed against
the chain of the step's own weight matmuls (train_vs_tunix.w3_rounds). A step's matmuls grow as
tokens x d_model^2, its elementwise passes (norms, gating, residuals, softmax, the optimizer's
update) as tokens x d_model, so the share of the step its matmuls can take grows with the width:
this says how much of W3's distance to its limit is the size of its model.

Rows per step shrink as the width grows so each step stays a few seconds on one core.

  taskset -c 1 python benchmarks/train_width.py [--layout 1+1|2x2] [--rounds 2] [--readme]
      ->  benchmarks/out/train_width_LAYOUT_MALLOC.json  (MALLOC: JAXRL_HEX_MALLOC: huge, keep or system)
  --readme rewrites the table in benchmarks/README.md from every such JSON present.
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import train_vs_tunix as w3  # noqa: E402  (sets up the CPU devices first)

from jaxrl_hex.host_memory import malloc_mode  # noqa: E402

# (d_model, sequences): sequences of 96 tokens (32 prompt + 64 completion), as W3
WIDTHS = ((256, 64), (512, 32), (1024, 16))


def model(d_model: int) -> dict:
  heads = d_model // 64
  return dict(w3.TINY, d_model=d_model, mlp_dim=4 * d_model, n_heads=heads, n_kv_heads=heads // 2)


def table() -> str:
  """The README's rows: ours / limit like for like per width, a column per (layout, malloc) run."""
  runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(HERE, "out", "train_width_*.json")))]
  head = " | ".join(f"{r['layout']}, malloc {r['malloc']}" for r in runs)
  rows = [f"| d_model (params, rows x 96 tokens) | {head} |", "|---" * (len(runs) + 1) + "|"]
  for i, (d_model, seqs) in enumerate(WIDTHS):
    w = runs[0]["widths"][i]
    cells = " | ".join(
        f"**{r['widths'][i]['of_limit']:.0%}** ({r['widths'][i]['matmul_gflops_per_s']:.0f} GFLOP/s)" for r in runs)
    rows.append(f"| {d_model} ({w['params'] / 1e6:.1f}M, {seqs} x 96) | {cells} |")
  return "\n".join(rows)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layout", choices=list(w3.W3_MESH_FILES), default="1+1")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--readme", action="store_true", help="rewrite the width table in benchmarks/README.md")
  args = ap.parse_args()
  rows = []
  for d_model, seqs in WIDTHS:
    r = w3.w3_rounds(seqs, 32, 64, args.rounds, args.layout, model(d_model))
    row = dict(d_model=d_model, seqs=seqs, params=r["limit"]["params"],
               of_limit=r["ours_without_shared_prompts"]["of_limit"], of_limit_shared_prompts=r["ours"]["of_limit"],
               step_s=r["ours_without_shared_prompts"]["step_s"], matmul_gflops_per_s=r["limit"]["matmul_gflops_per_s"])
    rows.append(row)
    print(
        f"d_model {d_model:5d} ({row['params'] / 1e6:5.1f}M params, {seqs} x 96 tokens): ours / limit "
        f"{row['of_limit']:.0%} like for like ({row['of_limit_shared_prompts']:.0%} with shared prompts), "
        f"step {row['step_s']:.2f} s, matmuls at {row['matmul_gflops_per_s']:.0f} GFLOP/s", flush=True)
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  malloc = malloc_mode()
  with open(os.path.join(HERE, "out", f"train_width_{args.layout}_{malloc}.json"), "w") as f:
    json.dump(dict(layout=args.layout, malloc=malloc, widths=rows), f, indent=1)
  if args.readme:
    from readme_section import write_section
    write_section("train-width", table(), "W3's step at growing widths")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
