"""The plan is the run: every mesh file the planner writes passes the runtime's checks, the plan's workload
becomes the run's batch, and bad replica groups fail in one line before any work starts."""
import argparse
import functools
import os
import pathlib
import subprocess
import sys

import pytest
import yaml
from support import ROOT, load_config

from jaxrl_hex import cluster, commands, config, meshes, runtime
from jaxrl_hex.errors import ConfigError, UserError
from jaxrl_hex.meshes import MeshError
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.planner import allocate
from jaxrl_hex.planner.command import plan_to_mesh
from jaxrl_hex.planner.model_files import load_model

MESHES = pathlib.Path(ROOT) / "meshes"
CLUSTERS = sorted(p.stem.removeprefix("cluster-") for p in MESHES.glob("cluster-*.yaml"))
MODELS = ("qwen2_1_5b", "qwen2_7b", "qwen2_14b")
# Every shipped cluster with the models that fit it (a 1.5B model on the cpu-8 cluster does not).
PLANS = [(c, m) for c in CLUSTERS for m in (("tiny",) if c.startswith("cpu") else MODELS)]


@functools.cache
def _policy(model):
  return Policy.build(load_model(model)[1])


def _run_config(mesh_file, model):
  """The default run config with the plan's model and workload, on the backend the file needs."""
  cfg = load_config()
  cfg.mesh_file = mesh_file.path
  cfg.model = load_model(model)[1]
  cfg.rollout.prompts_per_step = mesh_file.workload["batch_size"]
  cfg.rollout.group_size = mesh_file.workload["group_size"]
  if any(p.groups for p in mesh_file.pools.values()) or mesh_file.platform == "mixed":
    cfg.cluster.backend, cfg.sync.method = "ray", "orbax"
  return cfg


@pytest.mark.parametrize("name,model", PLANS)
def test_every_plan_the_planner_writes_passes_the_runtime_checks(name, model, tmp_path):
  plan_cluster = allocate.load_cluster(MESHES / f"cluster-{name}.yaml")
  p = allocate.plan(load_model(model)[1], plan_cluster, name=model)
  path = tmp_path / f"plan-{name}-{model}.yaml"
  path.write_text(yaml.safe_dump(plan_to_mesh(p, model, plan_cluster), sort_keys=False))

  mesh_file = meshes.load_mesh_file(str(path))
  w = p.workload
  assert mesh_file.workload == {"batch_size": w.batch_size, "group_size": w.group_size}
  cfg = _run_config(mesh_file, model)
  runtime.validate(cfg, mesh_file)
  cluster.check_config(cfg, mesh_file)
  policy = _policy(model)
  train, rollout = mesh_file.pools["train"], mesh_file.pools["rollout"]
  replicas = rollout.replica_specs()
  for spec in [train, *replicas]:
    spec.check_shardable(policy.logical_axes(), policy.shapes())
  assert w.sequences % train.batch_ways == 0 and cfg.sft.batch_size % train.batch_ways == 0
  catalog = plan_cluster.catalog[train.device_type]
  assert catalog.runtime_sizes_ok(len(train.device_ids))
  if rollout.groups:  # whole prompts per replica, covering the batch once
    prompts = [round(g.share * w.batch_size) for g in rollout.groups for _ in range(g.count)]
    assert sum(prompts) == w.batch_size and min(prompts) >= 1
    assert sum(g.count * g.share for g in rollout.groups) == pytest.approx(1.0)
    assert len(replicas) == sum(g.count for g in rollout.groups)
  else:  # one runtime in one host: what the local backend runs
    assert w.sequences % rollout.batch_ways == 0
    assert len(rollout.device_ids) <= plan_cluster.catalog[rollout.device_type].chips_per_host


def test_the_areal_hex_plan_no_longer_stops_on_batch_divisibility(tmp_path):
  """The issue's case: 21 H800 as data 7 x fsdp 3 divided neither 64 x 8 nor the default batch."""
  plan_cluster = allocate.load_cluster(MESHES / "cluster-areal-hex.yaml")
  p = allocate.plan(load_model("qwen2_1_5b")[1], plan_cluster, name="qwen2_1_5b")
  assert p.train.layout.mesh() == {"data": 2, "fsdp": 8, "tensor": 1}  # two whole 8-GPU hosts
  mesh = plan_to_mesh(p, "qwen2_1_5b", plan_cluster)
  assert mesh["pools"]["train"]["processes"] == 16 and mesh["pools"]["train"]["hosts"] == 2
  groups = mesh["pools"]["rollout"]["replicas"]
  assert sum(g["count"] * g["share"] for g in groups) == pytest.approx(1.0)
  assert all((g["share"] * 64).is_integer() for g in groups)  # whole prompts of the 64 per replica
  committed = yaml.safe_load((MESHES / "plan-areal-hex-qwen2_1_5b.yaml").read_text())
  assert mesh["pools"] == committed["pools"], "meshes/plan-areal-hex-qwen2_1_5b.yaml is the planner's output"


PLAN_FILE = """platform: cpu
num_devices: 8
pools:
  train: {devices: 4, mesh: {fsdp: 4}}
  rollout: {devices: 4, mesh: {data: 4}}
plan: {model: tiny, workload: {batch_size: 8, group_size: 2, prompt_len: 8},
       train: {remat: dots, micro_batch_tokens: 256}}
"""


def _main_config(tmp_path, monkeypatch, argv, gin=()):
  """The config `jaxrl-hex train` would run with, without running it."""
  seen = {}
  monkeypatch.setattr(commands, "train", lambda cfg, workdir, resume: seen.setdefault("cfg", cfg) and {})
  args = argparse.Namespace(config=os.path.join(ROOT, "configs/arith_grpo.py"), workdir=str(tmp_path / "run"),
                            resume=False, gin_file=[], gin_bindings=list(gin))
  commands._main("train", args, argv)
  return seen["cfg"]


def test_the_plans_workload_becomes_the_runs_batch_unless_the_user_sets_it(tmp_path, monkeypatch):
  plan = tmp_path / "plan.yaml"
  plan.write_text(PLAN_FILE)
  mesh = [f"--config.mesh_file={plan}"]
  cfg = _main_config(tmp_path, monkeypatch, mesh)
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (8, 2)
  assert (cfg.model.remat, cfg.algo.micro_batch_tokens) == ("dots", 256)  # the planner's train knobs too
  cfg = _main_config(tmp_path, monkeypatch, mesh + ["--config.model.remat=full"])
  assert (cfg.model.remat, cfg.algo.micro_batch_tokens) == ("full", 256)
  # a plan that fits only with adapters (`plan --lora-rank`) gives the run its adapters
  lora = tmp_path / "lora.yaml"
  lora.write_text(
      PLAN_FILE.replace("micro_batch_tokens: 256}", "micro_batch_tokens: 256, lora: {rank: 8, targets: "
                        "[q_proj, v_proj], serving: merged}}"))
  cfg = _main_config(tmp_path, monkeypatch, [f"--config.mesh_file={lora}"])
  assert (cfg.model.lora.rank, cfg.model.lora.targets, cfg.rollout.lora_serving) == (8, ("q_proj", "v_proj"), "merged")
  cfg = _main_config(tmp_path, monkeypatch, [f"--config.mesh_file={lora}", "--config.model.lora.rank=4"])
  assert cfg.model.lora.rank == 4
  cfg = _main_config(tmp_path, monkeypatch, mesh + ["--config.rollout.group_size=4"])
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (8, 4)
  cfg = _main_config(tmp_path, monkeypatch, mesh, gin=["rollout.prompts_per_step = 16"])
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (16, 2)
  cfg = _main_config(tmp_path, monkeypatch, [], gin=[f"config.mesh_file = '{plan}'"])  # the mesh file from gin
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (8, 2)
  # A hand-written mesh file has no workload: the config's batch stays.
  cfg = _main_config(tmp_path, monkeypatch, [f"--config.mesh_file={MESHES / 'cpu-8.yaml'}"])
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (32, 8)

  cfg = _main_config(tmp_path, monkeypatch, mesh + ["--config.rollout.prompts_per_step=3"])
  with pytest.raises(ConfigError) as e:
    runtime.validate(cfg, meshes.load_mesh_file(str(plan)))
  assert str(e.value) == (
      f"rollout.prompts_per_step x rollout.group_size = 6 does not divide the train pool's batch axes (4 ways); "
      f"rollout.prompts_per_step=3 overrides the plan's 8 in {plan}: drop the override or pick a multiple of 4 "
      f"(rollout.prompts_per_step a multiple of 2 at group_size 2)")


GROUPS = """platform: cpu
num_devices: 8
pools:
  train: {{devices: 2, mesh: {{fsdp: 2}}}}
  rollout:
    devices: {devices}
    mesh: {{data: 3, tensor: 2}}
    replicas:
    - {{count: 2, mesh: {{tensor: 1}}, share: {a}}}
    - {{count: 1, mesh: {{tensor: {t}}}, share: {b}}}
plan: {{workload: {{batch_size: 8, group_size: 2}}}}
"""


def _groups(tmp_path, a=0.25, b=0.5, t=2):
  path = tmp_path / "groups.yaml"
  path.write_text(GROUPS.format(devices=2 + t, a=a, b=b, t=t))
  return str(path)


def _group_config(path, **fields):
  cfg = load_config(**{"rollout.prompts_per_step": 8, "rollout.group_size": 2, **fields})
  cfg.mesh_file, cfg.model = path, load_model("tiny")[1]
  return cfg


def _one_line(error_type, fn, *args):
  with pytest.raises(error_type) as e:
    fn(*args)
  assert "\n" not in str(e.value) and isinstance(e.value, UserError)
  return str(e.value)


def test_replica_groups_that_the_runtime_cannot_run_fail_in_one_line(tmp_path):
  good = _groups(tmp_path)
  mesh_file = meshes.load_mesh_file(good)
  assert [(g.count, g.share) for g in mesh_file.pools["rollout"].groups] == [(2, 0.25), (1, 0.5)]
  cfg = _group_config(good, **{"cluster.backend": "ray", "sync.method": "orbax"})
  runtime.validate(cfg, mesh_file)
  cluster.check_config(cfg, mesh_file)

  # A tensor degree that does not divide the model's 4 heads and 2 KV heads.
  path = _groups(tmp_path, t=3)
  msg = _one_line(MeshError, runtime.validate, _group_config(path), meshes.load_mesh_file(path))
  assert msg.startswith(f"{path}: pools.rollout.replicas[1] (device_type None, mesh {{'tensor': 3}}): ")
  assert "['embed'] dim 0 ('vocab_in', size 16) does not divide over mesh axes ('tensor',) (size 3)" in msg
  assert msg.endswith("use a tensor degree that divides the model's 4 heads, 2 KV heads, MLP 256 and vocab 16: "
                      "one of [1, 2]")

  # Shares that do not cover the batch once.
  path = _groups(tmp_path, a=0.25, b=0.25)
  msg = _one_line(MeshError, meshes.load_mesh_file, path)
  assert msg == (f"{path}: pools.rollout.replicas: the shares cover 0.75 of a batch (sum of count x share over the "
                 "groups); make them sum to 1, or drop share to let the runtime divide the batch")
  # A plan's shares that are not whole prompt groups of this batch: 0.3 x 8 prompts. (Hand-written shares,
  # without plan.workload, are only the router's prior: they need to sum to 1, nothing more.)
  path = _groups(tmp_path, a=0.3, b=0.4)
  msg = _one_line(MeshError, runtime.validate, _group_config(path), meshes.load_mesh_file(path))
  hand_written = tmp_path / "hand.yaml"
  hand_written.write_text(
      pathlib.Path(path).read_text().replace("plan: {workload: {batch_size: 8, group_size: 2}}", ""))
  runtime.validate(_group_config(str(hand_written)), meshes.load_mesh_file(str(hand_written)))
  assert msg.startswith(f"{path}: pools.rollout.replicas[0].share = 0.3 gives each replica 4.8 of the 16 sequences")
  assert "make share x 8 prompts a whole number" in msg
  # ... and a user's batch that the plan's shares do not split: 0.25 x 6 prompts, naming the override.
  msg = _one_line(MeshError, runtime.validate, _group_config(good, **{"rollout.prompts_per_step": 6}), mesh_file)
  assert "replicas[0].share = 0.25 gives each replica 3 of the 12 sequences" in msg
  assert f"rollout.prompts_per_step=6 overrides the plan's 8 in {good}: drop the override or make share" in msg

  # Several replica groups on the local backend: the backend check says to use Ray, before any device.
  msg = _one_line(ConfigError, cluster.check_config, _group_config(good), mesh_file)
  assert msg.startswith(f"{good}: pools.rollout.replicas holds 2 replica group(s)")
  assert "use --config.cluster.backend=ray" in msg
  mixed = meshes.load_mesh_file(str(MESHES / "tpu-train-gpu-rollout.yaml"))
  msg = _one_line(ConfigError, cluster.check_config, _group_config(good), mixed)
  assert "platform mixed" in msg and msg.endswith("use --config.cluster.backend=ray")

  bad = tmp_path / "bad.yaml"
  bad.write_text(GROUPS.format(devices=4, a=0.25, b=0.5, t=2).replace("share: 0.5", "share: null"))
  assert "replicas[1] have no share while other groups do" in _one_line(MeshError, meshes.load_mesh_file, str(bad))
  bad.write_text(PLAN_FILE.replace("batch_size: 8", "batch_size: eight"))
  assert "plan.workload.batch_size must be a positive integer" in _one_line(MeshError, meshes.load_mesh_file, str(bad))
  bad.write_text(PLAN_FILE.replace("remat: dots", "remat: some"))
  assert "plan.train.remat='some' is not a valid model.remat" in _one_line(MeshError, meshes.load_mesh_file, str(bad))


def test_every_runtime_turns_on_the_persistent_compilation_cache(monkeypatch):
  """~/.cache/jaxrl_hex/xla unless JAX_COMPILATION_CACHE_DIR names a directory (JAX reads it itself)."""
  import jax

  from jaxrl_hex import runtime
  before = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    runtime.enable_compile_cache()
    assert jax.config.jax_compilation_cache_dir == runtime.COMPILE_CACHE_DIR
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")  # the user's choice: off
    jax.config.update("jax_compilation_cache_dir", "")
    runtime.enable_compile_cache()
    assert jax.config.jax_compilation_cache_dir == ""
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


def test_every_program_goes_into_the_cache_however_quick_its_compile(tmp_path):
  """A restart loads even the sub-second compiles (nearly all of a small model's) instead of
  compiling them again; JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS keeps a threshold the user sets."""
  code = ("from jaxrl_hex.runtime import enable_compile_cache; enable_compile_cache(); import jax; "
          "print(float(jax.jit(lambda x: x * 3 + 1)(2.0)))")

  def cached(name, **env):
    """-> the cache files a fresh process leaves after one quick compile (without the threshold
    tests/conftest.py sets for the suite)."""
    cache = tmp_path / name
    base = {k: v for k, v in os.environ.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    env = dict(base, JAX_COMPILATION_CACHE_DIR=str(cache), **env)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7.0"
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []

  assert len([n for n in cached("default") if n.endswith("-cache")]) == 1
  assert cached("threshold", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="60") == []


# The demo's shapes with SmolLM2's heads: 9 query and 3 KV heads, which tensor 2 cannot split.
NINE_HEADS = {"model.n_heads": 9, "model.n_kv_heads": 3, "model.head_dim": 8, "model.d_model": 48}


def test_the_default_mesh_file_lays_out_again_a_model_its_tensor_axis_cannot_split(capsys):
  cfg = load_config(**NINE_HEADS, mesh_file=config.DEFAULT_MESH_FILE)
  rt = runtime.build_runtime(cfg)
  assert {
      role: spec.axes for role, spec in rt.mesh_file.pools.items()
  } == {
      "train": {
          "fsdp": 4
      },
      "rollout": {
          "data": 4
      }
  }
  assert rt.mesh_file.pools["train"].device_ids == (0, 1, 2, 3)  # the same devices, another layout
  assert capsys.readouterr().err == (
      "jaxrl-hex: meshes/cpu-8.yaml: tensor 2 does not divide the model's 9 heads and 3 KV heads; running train on "
      "{fsdp: 4} and rollout on {data: 4} instead (name a layout with --config.mesh_file)\n")


def test_a_named_mesh_file_that_cannot_shard_the_model_names_one_that_can(tmp_path, capsys):
  named = tmp_path / "mine.yaml"
  named.write_text((MESHES / "cpu-8.yaml").read_text())
  msg = _one_line(MeshError, runtime.build_runtime, load_config(**NINE_HEADS, mesh_file=str(named)))
  assert msg == (f"{named}: pools.train (mesh {{fsdp: 2, tensor: 2}}) cannot shard the model: tensor 2 does not "
                 "divide the model's 9 heads and 3 KV heads; use --config.mesh_file=meshes/cpu-1-1.yaml, or give "
                 "pools.train.mesh {fsdp: 4}")
  # A model the shipped default already fits is not laid out again, and nothing is printed.
  rt = runtime.build_runtime(load_config(mesh_file=config.DEFAULT_MESH_FILE))
  assert rt.mesh_file.pools["train"].axes == {"fsdp": 2, "tensor": 2} and capsys.readouterr().err == ""


def test_auto_dtype_and_scan_are_chosen_for_the_model_and_platform_and_printed(capsys):
  demo = runtime.build_runtime(load_config(**{"model.dtype": "auto"}))
  assert (demo.cfg.model.dtype, demo.cfg.model.scan_layers) == ("float32", False)  # the demo as it always ran
  assert demo.policy.cfg.scan_layers is False and capsys.readouterr().err == ""
  deep = runtime.build_runtime(load_config(**{"model.dtype": "auto", "model.n_layers": 9}))
  assert (deep.cfg.model.dtype, deep.cfg.model.scan_layers, deep.policy.cfg.scan_layers) == ("float32", True, True)
  assert capsys.readouterr().err == (
      "jaxrl-hex: model settings chosen for this model and platform: model.dtype='float32' (on CPU bfloat16 computes "
      "slower), model.scan_layers=True (9 layers, one scanned layer compiles instead of all)\n")
  pinned = runtime.build_runtime(load_config(**{"model.n_layers": 9, "model.scan_layers": False}))
  assert pinned.cfg.model.scan_layers is False and capsys.readouterr().err == ""  # a value the config gives stands
  one_chip = meshes.load_mesh_file(str(MESHES / "single.yaml"))
  assert runtime.resolve_auto(load_config(**{"model.dtype": "auto"}), {
      "dtype": "auto"
  }, "gpu").startswith(
      "model settings chosen for this model and platform: model.dtype='bfloat16' (compute on gpu; the master weights "
      "stay float32)")
  assert runtime._platform(one_chip) == "cpu"  # `any`: this runtime's


def test_a_model_no_layout_of_the_pool_can_run_names_the_degrees_that_divide_it(tmp_path, monkeypatch):
  """Tensor 4 over 9 heads, and a batch of 6 that 4 batch ways cannot split; outside a checkout (no
  meshes/ to pick from) the message says what a layout needs."""
  named = tmp_path / "wide.yaml"
  named.write_text("platform: cpu\nnum_devices: 8\npools:\n  train: {devices: 4, mesh: {tensor: 4}}\n"
                   "  rollout: {devices: 1, mesh: {data: 1}}\n")
  monkeypatch.setattr(meshes, "shipped_mesh_files", lambda platform: [])
  cfg = load_config(**NINE_HEADS, mesh_file=str(named), **{"rollout.prompts_per_step": 3, "rollout.group_size": 2})
  msg = _one_line(MeshError, runtime.build_runtime, cfg)
  assert msg == (f"{named}: pools.train (mesh {{tensor: 4}}) cannot shard the model: tensor 4 does not divide the "
                 "model's 9 heads and 3 KV heads; no layout of its 4 devices shards it and divides this batch: give "
                 "pools.train a tensor degree in [1] and batch axes that divide the batch (one device always does)")
