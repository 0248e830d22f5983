"""Why a region joined from column halves copies slower than a flat memcpy (issue 20, weight sync).

A leaf split over fsdp on its last axis (wo, down, the embedding in the train layout) reaches a
rollout region whose rows are two sources' half-rows side by side. This times filling a
[rows, 2 x cols] float32 region from two [rows, cols] sources several ways, each against one flat
memcpy of the same bytes in the same run.

python benchmarks/row_copies.py [--rows 16384] [--cols 256] [--json benchmarks/out/row_copies.json]
"""
import argparse
import json
import os
import time

import numpy as np


def best_seconds(fn, repeats=20):
  fn()  # warm: pages touched, caches filled
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=16384)
  ap.add_argument("--cols", type=int, default=256, help="floats per source row (256: a 1 KB row, as wo and down)")
  ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "row_copies.json"))
  args = ap.parse_args()
  rows, cols = args.rows, args.cols
  rng = np.random.default_rng(0)
  left, right = (rng.random((rows, cols), np.float32) for _ in range(2))
  region = np.empty((rows, 2 * cols), np.float32)
  flat_src, flat_dst = rng.random(2 * rows * cols, np.float32), np.empty(2 * rows * cols, np.float32)
  void = np.dtype((np.void, cols * 4))

  def halves():  # what sync/regions.py does: one np.copyto per overlap
    np.copyto(region[:, :cols], left)
    np.copyto(region[:, cols:], right)

  def void_rows():  # a row as one element: a memmove per row
    np.copyto(region.view(void)[:, 0], left.view(void)[:, 0])
    np.copyto(region.view(void)[:, 1], right.view(void)[:, 0])

  def bounce(block=256):  # rows joined in a cache-sized buffer, then copied out contiguously
    scratch = np.empty((block, 2 * cols), np.float32)
    for r in range(0, rows, block):
      np.copyto(scratch[:, :cols], left[r:r + block])
      np.copyto(scratch[:, cols:], right[r:r + block])
      np.copyto(region[r:r + block], scratch)

  memcpy = best_seconds(lambda: np.copyto(flat_dst, flat_src))
  ways = {
      "two halves (np.copyto)": halves,
      "concatenate(out=)": lambda: np.concatenate([left, right], axis=1, out=region),
      "void rows": void_rows,
      "bounce buffer, 256 rows": bounce,
  }
  out = {"bytes": region.nbytes, "memcpy_s": memcpy, "ways": {}}
  for name, fn in ways.items():
    seconds = best_seconds(fn)
    np.testing.assert_array_equal(region, np.concatenate([left, right], axis=1))
    out["ways"][name] = {"seconds": seconds, "x_memcpy": seconds / memcpy}
    print(f"{name:26s} {seconds * 1e3:6.2f} ms = {seconds / memcpy:.2f}x one memcpy ({memcpy * 1e3:.2f} ms)")
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
