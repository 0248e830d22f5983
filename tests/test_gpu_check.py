"""benchmarks/gpu_check.py, the script an accelerator lease runs once: its --smoke run on this
machine's CPU produces every part's figures (the RL step's on the smoke shape, both pools on one
device as meshes/single.yaml lays them), and its byte and FLOP counts are the model's."""
import json
import os
import subprocess
import sys

from support import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import gpu_check  # noqa: E402  (benchmarks/ is no package)


def test_smoke_run_reports_every_part_with_the_models_counts(tmp_path):
  env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT, XLA_FLAGS="")
  subprocess.run([sys.executable, SCRIPT, "--smoke"], env=env, capture_output=True, text=True, check=True)
  got = json.loads((tmp_path / "gpu_check.json").read_text())
  decode, train, sync = got["decode"], got["train"], got["sync"]
  assert not any("error" in part for part in (decode, train, sync))
  # SMOKE: vocab 1024, d_model 256, 2 layers of 4 x 64 query and 2 x 64 KV heads, MLP 512, fp32
  layer = 256 * (4 * 64 * 2 + 2 * 64 * 2) + 3 * 256 * 512 + 2 * 256  # attention, MLP, two norms
  params = 2 * 1024 * 256 + 2 * layer + 256
  assert decode["params"] == params and sync["bytes"] == 4 * params
  # a decode step reads every weight but the embedding table, of which only its 8 rows' entries
  assert decode["weight_bytes_read"] == 4 * (params - 1024 * 256 + 8 * 256)
  # prompt 16, 32 new tokens in hand-backs of 16: the second hand-back's steps read 16 + 32 columns
  assert decode["columns_attended"] == 48.0
  kv = decode["kv_cache_bytes"]
  assert decode["bytes_per_step"] == decode["weight_bytes_read"] + kv * 48 // decode_length(kv)
  for where in (decode["profile"], train["profile"]):  # XLA:CPU's ops here, a GPU's kernels there
    assert where["top"] and 0 < where["busy_ms"] and 0 <= where["matmul_share"] <= 1
    assert sum(share for _, _, _, share in where["top"]) <= 1.001
  for figure in (decode["decode_tokens_per_s"], train["train_tokens_per_s"], sync["device_put"]["gb_per_s"],
                 sync["orbax"]["gb_per_s"], sync["direct shared memory"]["gb_per_s"]):
    assert figure > 0
  rl = got["rl"]["smoke"]
  assert "error" not in rl
  # --smoke: 2 prompts x 2 completions of 16 new tokens after 16-token prompts, fp32 weights
  assert (rl["params"], rl["param_bytes"], rl["rows"]) == (params, 4 * params, 4)
  # a decode step reads the weights (the embedding's 4 rows) and the KV of the prompt + half the new tokens:
  # 2 layers x (K + V) x 4 slots x 2 KV heads x 64 x fp32 a column
  assert rl["decode_step_bytes"] == 4 * (params - 1024 * 256 + 4 * 256) + 2 * 2 * 4 * 2 * 64 * 4 * 24
  # the roofline: 4 slots' tokens per step at the copy rate (rounded to 0.1 GB/s in the report)
  rate = lambda gb: 4 * gb * 1e9 / rl["decode_step_bytes"]
  assert rate(rl["copy_gb_per_s"] - 0.05) <= rl["roofline_tokens_per_s"] <= rate(rl["copy_gb_per_s"] + 0.05)
  for figure in (rl["sync_s"], rl["rollout_tokens_per_s"], rl["rollout_roofline_share"], rl["train_tokens_per_s"],
                 rl["share_of_matmul"]):
    assert figure > 0


def test_step_flops_count_every_matmul_weight_six_times_a_token_and_causal_attention():
  from jaxrl_hex.models.config import model_config
  cfg = model_config(**gpu_check.SMOKE)
  # per layer q, k, v, o (4 x 64 query, 2 x 64 KV heads over d_model 256) and the MLP (256 <-> 512)
  matmul = 2 * (256 * (4 * 64 * 2 + 2 * 64 * 2) + 3 * 256 * 512) + 256 * 1024  # + the output head
  # 2 x 64 tokens; attention: QK^T and PV, 2 FLOPs a product, 2 layers x 4 heads x 64, 32 keys on average
  tokens, attention = 2 * 64, 2 * 2 * 2 * 4 * 64 * 32
  assert gpu_check.step_flops(cfg, 2, 64) == 3 * tokens * (2 * matmul + attention)


def decode_length(kv_bytes: int) -> int:
  """The engine's ring length from its cache bytes: 2 layers x (K + V) x 8 slots x 2 x 64 x fp32."""
  return kv_bytes // (2 * 2 * 8 * 2 * 64 * 4)


def test_profile_counts_only_the_innermost_events_of_each_thread():
  event = lambda name, tid, ts, dur: dict(name=name, pid=1, tid=tid, ts=ts, dur=dur)
  events = [
      event("while", 1, 0, 100),
      event("dot", 1, 10, 30),
      event("add", 1, 40, 20),
      event("copy", 1, 60, 5),
      event("kernel", 2, 0, 100),
      event("after", 1, 100, 10)
  ]
  assert [e["name"] for e in gpu_check._leaves(events)] == ["dot", "add", "copy", "after", "kernel"]


def test_profile_takes_a_gpus_stream_kernels_not_its_op_lines_or_the_host():
  meta = lambda kind, pid, name, tid=None: dict(ph="M", name=kind, pid=pid, tid=tid, args=dict(name=name))
  run = lambda name, pid, tid: dict(ph="X", name=name, pid=pid, tid=tid, ts=0, dur=5)
  events = [
      meta("process_name", 1, "/host:CPU"),
      meta("process_name", 2, "/device:GPU:0"),
      meta("thread_name", 1, "python", 7),
      meta("thread_name", 2, "Stream #13(Compute)", 13),
      meta("thread_name", 2, "XLA Ops", 20),
      run("PjitFunction", 1, 7),
      run("gemm_fusion", 2, 13),
      run("dot.3", 2, 20)
  ]
  assert [e["name"] for e in gpu_check._device_ops(events)] == ["gemm_fusion"]
