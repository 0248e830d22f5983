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


def test_instructions_are_read_from_the_compiled_programs_text(tmp_path, monkeypatch):
  loop = lambda x, w: jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)  # a weight matmul in a loop
  text = jax.jit(loop).lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile().as_text()
  (tmp_path / "module_0007.jit_decode.cpu_after_optimizations.txt").write_text(text)
  monkeypatch.setattr(decode_profile, "DUMP", str(tmp_path))
  got = decode_profile._instructions()
  dots = [(pid, module, rank) for (pid, _), (module, rank, _, op_name) in got.items() if op_name.endswith("dot_general")
         ]
  assert dots and all(d == (7, "jit_decode", 2) for d in dots)
  categories = {decode_profile.category(*v[:2], v[3]) for v in got.values()}
  assert "decode loop: weight matmuls" in categories and "decode loop: other ops" in categories


@pytest.mark.parametrize("module, rank, op_name, want", [
    ("jit_decode", 2, "jit(decode)/while/body/dot_general", "decode loop: weight matmuls"),
    ("jit_decode", 4, "jit(decode)/while/body/dot_general", "decode loop: attention matmuls"),
    ("jit_decode", 4, "jit(decode)/while/body/dynamic_update_slice", "decode loop: cache writes"),
    ("jit_decode", 2, "jit(decode)/while/body/exp", "decode loop: other ops"),
    ("jit_decode", 4, "jit(decode)/slice", "decode, per call"),
    ("jit_prefill", 2, "jit(prefill)/dot_general", "prefill: weight matmuls"),
    ("jit_prefill", 4, "jit(prefill)/bhgqk,bhkd->bhgqd/dot_general", "prefill: attention matmuls"),
    ("jit_prefill", 4, "jit(prefill)/dynamic_update_slice", "prefill: cache writes"),
    ("jit__sample_keys", 1, "jit(_sample_keys)/add", "other programs"),
])
def test_each_thunk_lands_in_its_category(module, rank, op_name, want):
  assert decode_profile.category(module, rank, op_name) == want


def test_idle_time_is_counted_inside_the_loops_only():
  # a loop [0, 100) with thunks [10, 30) and [20, 50): idle 0-10 and 50-100; a thunk outside it
  assert decode_profile.idle_within([(0, 100)], [(10, 30, 1, "a"), (20, 50, 1, "b"), (200, 300, 1, "c")]) == \
      pytest.approx(60e-9)
