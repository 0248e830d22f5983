"""benchmarks/decode_profile.py's bookkeeping: thunks running at once share their wall time, a
compiled program's instructions are read back from XLA's own text, and each lands in its category."""
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from support import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import decode_profile  # noqa: E402  (benchmarks/ is no package)


def test_thunks_running_at_once_split_their_time():
  # [0, 10) alone 0-5 then shared 5-10; [5, 15) shared 5-10 then alone 10-15; [20, 30) alone
  got = decode_profile.shares([(0, 10, 1, "a"), (5, 15, 1, "b"), (20, 30, 1, "c")])
  assert got == pytest.approx({0: 7.5e-9, 1: 7.5e-9, 2: 10e-9})
  assert sum(got.values()) == pytest.approx(25e-9)  # the busy wall time, 20-30 and 0-15


def test_a_waiting_thunk_counts_only_while_nothing_else_runs():
  # a collective [0, 10) waits on a matmul [0, 6) (another device's), then runs alone 6-10
  got = decode_profile.shares([(0, 10, 1, "all-reduce"), (0, 6, 1, "dot")], waiting={0})
  assert got == pytest.approx({0: 4e-9, 1: 6e-9})
  assert decode_profile.shares([(0, 10, 1, "all-reduce"), (0, 6, 1, "dot")]) == pytest.approx({0: 7e-9, 1: 3e-9})


def test_instructions_are_read_from_the_compiled_programs_text(tmp_path, monkeypatch):
  loop = lambda x, w: jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)  # a weight matmul in a loop
  text = jax.jit(loop).lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile().as_text()
  (tmp_path / "module_0007.jit_decode.cpu_after_optimizations.txt").write_text(text)
  monkeypatch.setattr(decode_profile, "DUMP", str(tmp_path))
  got = decode_profile._instructions()
  dots = [
      (pid, module, rank, in_loop) for (pid, _), (module, rank, opcode, _, in_loop) in got.items() if opcode == "dot"
  ]
  assert dots and all(d == (7, "jit_decode", 2, True) for d in dots)
  categories = {decode_profile.category(*v) for v in got.values()}
  assert "decode loop: weight matmuls" in categories and "decode loop: other ops" in categories


def test_collectives_and_fused_dots_are_told_by_the_programs_structure(tmp_path, monkeypatch):
  # on a 2-device mesh: the partitioner's all-reduce after the sharded contraction carries no
  # op_name; that it runs inside the loop comes from the while's body
  mesh = jax.make_mesh((2,), ("tensor",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
  shard = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  loop = lambda x, w: jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)
  x = jax.device_put(jnp.ones((8, 16)), shard(None, "tensor"))
  w = jax.device_put(jnp.ones((16, 16)), shard("tensor", None))
  text = jax.jit(loop, out_shardings=shard()).lower(x, w).compile().as_text()
  (tmp_path / "module_0003.jit_decode.cpu_after_optimizations.txt").write_text(text)
  monkeypatch.setattr(decode_profile, "DUMP", str(tmp_path))
  got = decode_profile._instructions()
  reduces = [v for (_, name), v in got.items() if v[2] == "all-reduce"]
  assert reduces and {decode_profile.category(*v) for v in reduces} == {"decode loop: collectives"}
  dots = [v for v in got.values() if v[2] == "dot"]
  assert dots and {decode_profile.category(*v) for v in dots} == {"decode loop: weight matmuls"}


@pytest.mark.parametrize("module, rank, opcode, op_name, in_loop, want", [
    ("jit_decode", 2, "fusion", "jit(decode)/while/body/dot_general", False, "decode loop: weight matmuls"),
    ("jit_decode", 4, "dot", "jit(decode)/while/body/dot_general", False, "decode loop: attention matmuls"),
    ("jit_decode", 3, "dot", "", True, "decode loop: attention matmuls"),
    ("jit_decode", 4, "fusion", "jit(decode)/while/body/dynamic_update_slice", False, "decode loop: cache writes"),
    ("jit_decode", 2, "all-reduce", "", True, "decode loop: collectives"),
    ("jit_decode", 2, "fusion", "jit(decode)/while/body/exp", False, "decode loop: other ops"),
    ("jit_decode", 4, "slice", "jit(decode)/slice", False, "decode, per call"),
    ("jit_decode", 2, "all-gather", "", False, "decode, per call"),
    ("jit_prefill", 2, "dot", "jit(prefill)/dot_general", False, "prefill: weight matmuls"),
    ("jit_prefill", 4, "dot", "jit(prefill)/bhgqk,bhkd->bhgqd/dot_general", False, "prefill: attention matmuls"),
    ("jit_prefill", 4, "fusion", "jit(prefill)/dynamic_update_slice", False, "prefill: cache writes"),
    ("jit_prefill", 2, "all-reduce", "", False, "prefill: collectives"),
    ("jit__sample_keys", 1, "add", "jit(_sample_keys)/add", False, "other programs"),
])
def test_each_thunk_lands_in_its_category(module, rank, opcode, op_name, in_loop, want):
  assert decode_profile.category(module, rank, opcode, op_name, in_loop) == want


def test_idle_time_is_counted_inside_the_loops_only():
  # a loop [0, 100) with thunks [10, 30) and [20, 50): idle 0-10 and 50-100; a thunk outside it
  assert decode_profile.idle_within([(0, 100)], [(10, 30, 1, "a"), (20, 50, 1, "b"), (200, 300, 1, "c")]) == \
      pytest.approx(60e-9)
