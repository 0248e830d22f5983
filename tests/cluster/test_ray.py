"""The Ray backend on one machine: a two-process train pool (one global mesh over gloo) and
rollout replicas in their own runtimes."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml
from support import ROOT, SMALL, load_config

from jaxrl_hex import cli
from jaxrl_hex.cluster.local import LocalRolloutSide, LocalTrainSide
from jaxrl_hex.cluster.ray_backend import connect, direct_transport, ray_sides
from jaxrl_hex.errors import UserError
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.rl.batch import rl_batch
from jaxrl_hex.runtime import build_runtime
from jaxrl_hex.sync import make_sync

RAY_MESH = os.path.join(ROOT, "meshes", "cpu-ray.yaml")


class _Quiet:
  t0 = 0.0

  def log(self, row):
    pass


def _ray_cfg(warm_workdir, **extra):
  return load_config(
      **SMALL, **{
          "init_from": warm_workdir,
          "mesh_file": RAY_MESH,
          "cluster.backend": "ray",
          "sync.method": "orbax",
          **extra
      })


# orbax through the same two-process trainer is slow-marked (50 s): tests/sync covers its resharding in-process
@pytest.mark.parametrize("method", [pytest.param("orbax", marks=pytest.mark.slow), "direct"])
def test_two_process_trainer_matches_one_process_and_sync_preserves_values(ray_session, warm_workdir, tmp_path, method):
  cfg = _ray_cfg(warm_workdir, **{"sync.method": method})
  rt = build_runtime(cfg)
  train, rollout = ray_sides(rt, str(tmp_path / "ray"), resume=False)
  try:
    # the same batch through a one-process trainer with the same (fsdp=2, tensor=2) mesh
    local_cfg = load_config(**SMALL, init_from=warm_workdir)
    local_rt = build_runtime(local_cfg)
    sync = make_sync("device_put", local_rt.policy.shapes(), local_rt.shardings("rollout"))
    local = LocalTrainSide(local_rt, str(tmp_path / "local"), False, _Quiet(), sync)
    sampler = LocalRolloutSide(local_rt, sync)
    records = [dict(r, index=i) for i, r in enumerate(local_rt.task.train[:8])]
    batch, _, _ = sampler.generate(records, 4, 0, 0, local.publish())
    batch.rewards = np.arange(32, dtype=np.float32) % 3
    batch = rl_batch(batch)
    want, got = local.step(batch), train.step(batch)
    assert got["loss"] != 0
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)

    # train layout (2 processes, fsdp x tensor) -> rollout layout (1 process, data x tensor)
    handle = train.publish()
    assert handle.version == 1 and train.sync_seconds > 0
    if method == "direct":  # auto: two train processes write through the object store
      assert train.describe()["sync"] == "direct (object_store)"
    worker = rollout.workers[0]
    import ray
    assert ray.get(worker.receive.remote(handle)) == 1
    sent = ray.get([w.fetch_params.remote() for w in train.workers])[0]  # a collective: every process
    received = ray.get(worker.fetch_params.remote())
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sent), jax.tree.leaves(received)):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    local_params = jax.device_get(local.trainer.params)
    for a, b in zip(jax.tree.leaves(sent), jax.tree.leaves(local_params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # weights offered while a replica generates reach it within that batch (interruptible generation)
    train.step(batch)
    newer = train.publish()
    many = [dict(r, index=i) for i, r in enumerate(rt.task.train[:256])]
    pending = worker.generate.remote(many, 8, 0, 1, handle)  # started on version 1
    ray.get(worker.offer.remote(newer), timeout=60)  # served beside the running generate
    assert not ray.wait([pending], timeout=0)[0], "generation ended before the offer: make it longer"
    out, _, _ = ray.get(pending)
    versions = set(out.versions[out.completion_mask].tolist())
    assert versions <= {1, 2} and 2 in versions
  finally:
    train.close()
    rollout.close()


def test_bad_cluster_input_fails_before_work(ray_session, warm_workdir, tmp_path, capsys):
  with pytest.raises(UserError, match="not reachable"):
    connect("127.0.0.1:1")
  mesh = tmp_path / "hosts.yaml"
  mesh.write_text(open(RAY_MESH).read().replace("processes: 2", "processes: 2\n    hosts: 3"))
  base = ["train", f"--config.init_from={warm_workdir}", "--config.cluster.backend=ray", "--config.sync.method=orbax"]
  assert cli.main(base + [f"--workdir={tmp_path}/a", f"--config.mesh_file={mesh}"]) == 2
  assert "pools.train spans 3 hosts but the Ray cluster has 1 node" in capsys.readouterr().err
  blocker = tmp_path / "blocker"
  blocker.write_text("")
  assert cli.main(
      base +
      [f"--workdir={tmp_path}/b", f"--config.mesh_file={RAY_MESH}", f"--config.sync.directory={blocker}/sync"]) == 2
  assert "sync.directory: cannot write" in capsys.readouterr().err
  direct = ["--config.sync.method=direct", "--config.sync.transport=shared_memory", f"--config.mesh_file={RAY_MESH}"]
  assert cli.main(base + [f"--workdir={tmp_path}/c"] + direct) == 2
  assert ("sync.transport=shared_memory: pools.train.processes is 2 (one train process writes the versions); use "
          "--config.sync.transport=object_store") in capsys.readouterr().err
  # a pool whose processes cannot start (the train pool: no best checkpoint to start from) stops
  # the start of both pools, which start side by side, with its own one-line error
  assert cli.main([
      "train", f"--workdir={tmp_path}/d", f"--config.init_from={warm_workdir}:best", "--config.cluster.backend=ray",
      "--config.sync.method=direct", f"--config.mesh_file={RAY_MESH}"
  ]) == 2
  assert f"init_from={warm_workdir}:best: " in capsys.readouterr().err


def test_direct_sync_goes_through_shared_memory_where_it_can(ray_session, monkeypatch):
  from jaxrl_hex.meshes import load_mesh_file
  from jaxrl_hex.sync import shared_memory
  one_host, two_processes = load_mesh_file(MIXED_MESH), load_mesh_file(RAY_MESH)
  assert direct_transport("auto", one_host, 1 << 20) == "shared_memory"
  assert direct_transport("auto", two_processes, 1 << 20) == "object_store"
  assert direct_transport("object_store", one_host, 1 << 20) == "object_store"
  monkeypatch.setattr(shared_memory, "room", lambda: 100 << 20)  # two layouts x 4 versions of 16 MiB: 128 MiB
  assert direct_transport("auto", one_host, 16 << 20) == "object_store"
  with pytest.raises(UserError, match="/dev/shm has 100 MiB free of the 128 MiB that 4 versions on 2 rollout layout"):
    direct_transport("shared_memory", one_host, 16 << 20)


def test_worker_actors_start_with_the_drivers_glibc_tunables(ray_session, monkeypatch):
  """host_memory's huge pages reach workers on every node, not only the ones this driver started:
  glibc reads GLIBC_TUNABLES when a process starts. A mesh file's own runtime_env is kept."""
  import dataclasses

  import ray

  from jaxrl_hex.cluster.ray_backend import _actor, actor_options
  from jaxrl_hex.meshes import load_mesh_file
  spec = load_mesh_file(RAY_MESH).pools["rollout"]
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")

  class Probe:

    def environ(self):
      return open("/proc/self/environ", "rb").read().split(b"\0")

  probe = _actor(Probe, spec).remote()
  assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in ray.get(probe.environ.remote())
  ray.kill(probe)
  own = dataclasses.replace(spec, ray_options={"num_gpus": 1, "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}})
  assert actor_options(own, {"GLIBC_TUNABLES": "t=1"}, max_restarts=0) == {
      "num_cpus": 0,
      "max_restarts": 0,
      "num_gpus": 1,
      "runtime_env": {
          "env_vars": {
              "GLIBC_TUNABLES": "t=1",
              "A": "1"
          },
          "pip": ["x"]
      }
  }
  assert actor_options(own, {}) == {"num_cpus": 0, **own.ray_options}


def test_hung_rollout_workers_are_replaced_then_the_run_gives_up(ray_session, warm_workdir, tmp_path):
  from jaxrl_hex import commands
  cfg = _ray_cfg(warm_workdir, **{"cluster.worker_timeout_s": 0.01, "cluster.max_restarts": 1, "train.steps": 2})
  with pytest.raises(RuntimeError, match=r"lost 2 times \(cluster.max_restarts=1\)"):
    commands.train(cfg, str(tmp_path / "run"))


def _train_command(workdir, warm_workdir, mesh_file, steps, **overrides):
  """`jaxrl-hex train` on the Ray backend with direct sync, as a subprocess to kill parts of."""
  return [
      sys.executable, "-m", "jaxrl_hex.cli", "train", f"--workdir={workdir}", f"--config.init_from={warm_workdir}",
      f"--config.mesh_file={mesh_file}", "--config.cluster.backend=ray", "--config.sync.method=direct",
      f"--config.train.steps={steps}", "--config.train.eval_every=100",
      *[f"--config.{k}={v}" for k, v in dict(SMALL, **overrides).items()]
  ]


def test_lost_rollout_and_train_processes_and_a_sigterm_lose_and_repeat_no_prompt(warm_workdir, tmp_path):
  """One run, three faults. A killed rollout process is replaced with the run going on. A lost
  train process stops the run with a one-line message (its peers cannot go on alone); --resume
  restarts the whole cluster from the last checkpoint. A SIGTERM to the resumed run (a preempted
  VM) checkpoints its last step and exits 3; a second --resume finishes, and every batch holds
  exactly the prompts an undisturbed stream hands out, each trained once."""
  workdir = tmp_path / "run"
  steps = 10
  cmd = [
      sys.executable, "-m", "jaxrl_hex.cli", "train", f"--workdir={workdir}", f"--config.init_from={warm_workdir}",
      f"--config.mesh_file={RAY_MESH}", "--config.cluster.backend=ray", "--config.sync.method=direct",
      f"--config.train.steps={steps}", "--config.train.eval_every=100", "--config.train.checkpoint_every=2",
      *[f"--config.{k}={v}" for k, v in SMALL.items()]
  ]
  env = dict(os.environ, JAXRL_HEX_QUIET="1")
  metrics = workdir / "metrics.jsonl"
  trained = lambda: [r for r in read_jsonl(metrics)
                     if r.get("phase") == "train" and "prompt_ids" in r] if metrics.exists() else []
  processes = lambda role: json.load(open(workdir / "cluster.json"))[role]["processes"]

  def run_until(extra, fault):
    """Runs cmd + extra, calling fault() every 0.2 s until it returns True -> (exit status, output)."""
    proc = subprocess.Popen(cmd + extra, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    done, deadline = False, time.time() + 600
    while proc.poll() is None and time.time() < deadline:
      done = done or fault(proc)
      time.sleep(0.2)
    assert done, "the run finished before its fault"
    return proc.returncode, proc.communicate()[0].decode()

  killed_rollout = []

  def kill_a_rollout_then_a_train_process(_):
    if not killed_rollout and len(trained()) >= 2:
      killed_rollout.append(processes("rollout")[0]["pid"])
      os.kill(killed_rollout[0], signal.SIGKILL)
    # once the replica was replaced, and a checkpoint is complete (saves are asynchronous: one in flight is lost)
    replaced = killed_rollout and processes("rollout")[0]["pid"] != killed_rollout[0]
    if replaced and len(trained()) >= 5 and (workdir / "checkpoints" / "4").exists():
      os.kill(processes("train")[1]["pid"], signal.SIGKILL)
      return True
    return False

  code, out = run_until([], kill_a_rollout_then_a_train_process)
  assert code == 3, out[-3000:]
  assert "a train process was lost" in out and "--resume" in out and "Traceback" not in out
  assert len(trained()) < steps
  assert any(s["kind"] == "replaced" for s in read_jsonl(workdir / "spans.jsonl"))

  resumed_at = []

  def sigterm(proc):
    rows = trained()
    if not resumed_at and any("resumed_from" in r for r in rows):
      resumed_at.append(len(rows))
    if resumed_at and len(rows) >= resumed_at[0] + 1:
      proc.send_signal(signal.SIGTERM)
      return True
    return False

  code, out = run_until(["--resume"], sigterm)
  assert code == 3 and "stopped by SIGTERM at step" in out and "Traceback" not in out, out[-3000:]
  stopped = int(out.split("stopped by SIGTERM at step ")[1].split()[0])
  assert (workdir / "checkpoints" / str(stopped)).is_dir() and stopped < steps

  resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
  rows = trained()
  assert [r["batch"] for r in rows] == list(range(steps))  # one row per step, the resumed runs' after theirs
  starts = [r["resumed_from"] for r in rows if "resumed_from" in r]
  assert len(starts) == 2 and starts[0] % 2 == 0 and starts[0] >= 4 and starts[1] == stopped
  from jaxrl_hex.data.prompts import PromptStream
  stream = PromptStream(build_runtime(load_config(**SMALL)).task.train, SMALL["rollout.prompts_per_step"], seed=0)
  for r in rows:
    assert r["prompt_ids"] == sorted(rec["index"] for rec in stream.next()[0])
  assert json.load(open(workdir / "summary.json"))["steps"] == steps - stopped


MIXED_MESH = os.path.join(ROOT, "meshes", "cpu-mixed.yaml")
MIXED_CLUSTER = os.path.join(ROOT, "meshes", "cluster-cpu-mixed.yaml")
MIXED_PLAN = os.path.join(ROOT, "meshes", "plan-cpu-mixed-tiny.yaml")


def test_the_planners_plan_for_this_machine_runs_through_train(ray_session, warm_workdir, tmp_path):
  """`jaxrl-hex plan` on the cluster file describing this machine, then `jaxrl-hex train` on what
  it wrote, unchanged: the plan's pools, replica groups, pinning and batch."""
  plan = tmp_path / "plan.yaml"
  assert cli.main(["plan", "--cluster", MIXED_CLUSTER, "--model", "tiny", "--out", str(plan)]) == 0
  written = yaml.safe_load(plan.read_text())
  assert written == yaml.safe_load(open(MIXED_PLAN)), "meshes/plan-cpu-mixed-tiny.yaml is the planner's output"
  workdir = tmp_path / "run"
  steps = 2
  assert cli.main([
      "train", f"--workdir={workdir}", f"--config.init_from={warm_workdir}", f"--config.mesh_file={plan}",
      "--config.cluster.backend=ray", "--config.sync.method=direct", f"--config.train.steps={steps}",
      "--config.train.eval_every=100", "--config.train.eval_size=16"
  ]) == 0
  from jaxrl_hex.meshes import load_mesh_file
  workload = written["plan"]["workload"]
  replicas = load_mesh_file(str(plan)).pools["rollout"].replica_specs()  # each its own runtime
  rows = [r for r in read_jsonl(workdir / "metrics.jsonl") if r.get("phase") == "train" and "batch" in r]
  assert len(rows) == steps
  for r in rows:  # the plan's batch, spread over every replica
    assert len(r["prompt_ids"]) == workload["batch_size"]
    assert len(r["rollout_replicas"]) == len(replicas)
    assert sum(x["prompts"] for x in r["rollout_replicas"]) == workload["batch_size"]
  cluster = json.load(open(workdir / "cluster.json"))
  processes = [p for g in cluster["rollout"]["groups"] for p in g["processes"]]
  assert [(p["device_type"], p["mesh"], p["cores"]) for p in processes
         ] == [(s.device_type, dict(s.axes), list(s.affinity)) for s in replicas]
  assert [p["cores"] for p in cluster["train"]["processes"]] == [written["pools"]["train"]["affinity"]]
  spans = read_jsonl(workdir / "spans.jsonl")
  (train_start,) = [s for s in spans if s["pool"] == "train" and s["kind"] == "start"]
  replica_starts = [s for s in spans if s["pool"] == "rollout" and s["kind"] == "start"]
  assert sorted(s["replica"] for s in replica_starts) == list(range(len(replicas)))
  # the pools start side by side: every replica was asked for before the train process began its
  # start (one after the other, no replica's start began before the train pool's had ended)
  assert all(s["start"] < train_start["start"] for s in replica_starts)


def test_mixed_fleet_routes_every_prompt_once_and_every_layout_gets_the_trainers_weights(
    ray_session, warm_workdir, tmp_path):
  """Two replica groups of different layouts (tensor 2; two single devices): each replica is its
  own runtime with its group's layout, batches are routed over all of them, and after a few RL
  steps every replica holds exactly the trainer's weights."""
  import ray

  from jaxrl_hex.metrics import Recorder
  from jaxrl_hex.orchestrator import Orchestrator
  steps = 3
  cfg = load_config(
      **{
          **SMALL, "init_from": warm_workdir,
          "mesh_file": MIXED_MESH,
          "cluster.backend": "ray",
          "sync.method": "direct",
          "train.steps": steps,
          "train.eval_every": 100,
          "train.eval_size": 16
      })
  workdir = str(tmp_path / "mixed")
  rt = build_runtime(cfg)
  train, rollout = ray_sides(rt, workdir, resume=False)
  recorder = Recorder(workdir)
  try:
    assert rollout.replicas == 3 and rollout.group_of == [0, 1, 1]
    described = rollout.describe()
    assert [g["mesh"] for g in described["groups"]] == [{"tensor": 2}, {"data": 1}]
    assert [p["mesh"] for p in described["processes"]] == [{"tensor": 2}, {"data": 1}, {"data": 1}]
    assert [len(p["local_devices"]) for p in described["processes"]] == [2, 1, 1]
    assert len({p["pid"] for p in described["processes"]}) == 3
    assert train.describe()["sync"] == "direct (shared_memory)"  # auto: one train process, one host
    Orchestrator(rt, train, rollout, recorder).run()

    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train" and "batch" in r]
    assert [r["batch"] for r in rows] == list(range(steps))
    from jaxrl_hex.data.prompts import PromptStream
    stream = PromptStream(rt.task.train, SMALL["rollout.prompts_per_step"], seed=0)
    for r in rows:  # each batch holds exactly the prompts the stream handed out for it, once each
      assert r["prompt_ids"] == sorted(rec["index"] for rec in stream.next()[0])
    spans = read_jsonl(os.path.join(workdir, "spans.jsonl"))
    chunks = [s for s in spans if s["kind"] == "generate_chunk"]
    assert {s["replica"] for s in chunks} == {0, 1, 2}, "every replica generated prompts"
    for k in range(steps):
      assert sum(s["prompts"] for s in chunks if s["batch"] == k) == SMALL["rollout.prompts_per_step"]
    routes = [s for s in spans if s["kind"] == "route"]
    assert len(routes) == steps and all(len(s["replicas"]) == 3 for s in routes)
    for r, route in zip(rows, sorted(routes, key=lambda s: s["batch"])):  # each batch's routing in its row
      assert [(x["replica"], x["group"]) for x in r["rollout_replicas"]] == [(0, 0), (1, 1), (2, 1)]
      assert [x["prompts"] for x in r["rollout_replicas"]] == [x["prompts"] for x in route["replicas"]]
      assert sum(x["prompts"] for x in r["rollout_replicas"]) == SMALL["rollout.prompts_per_step"]
      assert sum(x["tokens"] for x in r["rollout_replicas"]) > 0
      fastest = [x for x in route["replicas"] if x["group"] == r["rollout_fastest_group"]]
      window = route["end"] - route["start"]
      assert r["rollout_fastest_idle_share"] == pytest.approx(
          sum(x["idle_s"] for x in fastest) / (len(fastest) * window), rel=1e-4)
    assert {s["group"] for s in spans if s["kind"] == "receive"} == {0, 1}
    assert all(s["bytes"] > 0 for s in spans if s["kind"] == "receive")

    # the planner's calibration reads each group's decode step time from the run's route spans
    from jaxrl_hex.calibration import run_records
    from jaxrl_hex.config import write_run_config
    write_run_config(cfg, workdir)
    decoding = [r for r in run_records(workdir) if r["pool"] == "rollout"]
    assert [(r["mesh"], r["devices"], r["batch"]) for r in decoding] == [({
        "data": 1,
        "tensor": 2
    }, 2, rollout.slots[0]), ({
        "data": 2,
        "tensor": 1
    }, 2, rollout.slots[1])]
    last = {r["replica"]: r["decoded"] for r in routes[-1]["replicas"]}
    assert all(last[i]["slot_steps"] > 0 and 0 < last[i]["tokens"] <= last[i]["slot_steps"] for i in range(3))
    assert all(0 < last[i]["decode_s"] < last[i]["gen_s"] for i in range(3))  # prefill and host work are no decode
    step_s = last[0]["decode_s"] / (last[0]["slot_steps"] / rollout.slots[0])
    assert decoding[0]["decode_tokens_per_s"] == pytest.approx(rollout.slots[0] / step_s)

    # the newest weights onto every layout: equal to the trainer's, value for value
    handle = train.publish()
    sent = ray.get([w.fetch_params.remote() for w in train.workers])[0]
    assert ray.get([w.receive.remote(handle) for w in rollout.workers]) == [handle.version] * 3
    for worker in rollout.workers:
      received = ray.get(worker.fetch_params.remote())
      for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sent), jax.tree.leaves(received)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  finally:
    train.close()
    rollout.close()
    recorder.close()


# 50 s: slow-marked; its one-group form is in test_lost_rollout_and_train_processes_and_a_sigterm_lose_..._prompt
@pytest.mark.slow
def test_killed_replica_of_either_group_loses_and_repeats_no_prompt(warm_workdir, tmp_path):
  """On the mixed fleet, a replica of each group is killed mid-run: each is replaced with its own
  layout, its chunk goes back to the router, and every batch holds its prompts exactly once."""
  workdir = tmp_path / "run"
  steps = 14
  cmd = _train_command(workdir, warm_workdir, MIXED_MESH, steps, **{"train.eval_size": 16})
  proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, JAXRL_HEX_QUIET="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  metrics = workdir / "metrics.jsonl"
  killed = {}  # replica -> pid
  deadline = time.time() + 600
  while proc.poll() is None and time.time() < deadline:
    done = [r for r in read_jsonl(metrics) if r.get("phase") == "train"] if metrics.exists() else []
    for replica, after in ((0, 2), (2, 4)):  # group 0 (tensor 2), then group 1 (a single device)
      if replica not in killed and len(done) >= after:
        killed[replica] = json.load(open(workdir / "cluster.json"))["rollout"]["processes"][replica]["pid"]
        os.kill(killed[replica], signal.SIGKILL)
    time.sleep(0.05)
  out = proc.communicate()[0].decode()
  assert proc.returncode == 0, out[-3000:]
  assert set(killed) == {0, 2}
  lost = [s for s in read_jsonl(workdir / "spans.jsonl") if s["kind"] == "lost"]
  assert {s["replica"] for s in lost} == {0, 2}  # the chunk each held went back to the router
  assert json.load(open(workdir / "summary.json"))["rollout_restarts"] >= 2
  # each replaced by a new process with the same layout (cluster.json is rewritten once it is up;
  # the run may end first, its generation being quicker than a process start)
  replaced = {s["replica"]: s["process"] for s in read_jsonl(workdir / "spans.jsonl") if s["kind"] == "replaced"}
  assert set(replaced) == {0, 2}
  assert replaced[0]["mesh"] == {"tensor": 2} and replaced[2]["mesh"] == {"data": 1}
  assert all(replaced[r]["pid"] != pid for r, pid in killed.items())
  cluster = json.load(open(workdir / "cluster.json"))["rollout"]
  assert [p["replica"] for p in cluster["processes"]] == [0, 1, 2]
  assert [g["mesh"] for g in cluster["groups"]] == [{"tensor": 2}, {"data": 1}]
  rows = [r for r in read_jsonl(metrics) if r.get("phase") == "train" and "prompt_ids" in r]
  assert [r["batch"] for r in rows] == list(range(steps))
  from jaxrl_hex.data.prompts import PromptStream
  stream = PromptStream(build_runtime(load_config(**SMALL)).task.train, SMALL["rollout.prompts_per_step"], seed=0)
  for r in rows:
    assert r["prompt_ids"] == sorted(rec["index"] for rec in stream.next()[0])


def test_a_replica_group_the_ray_cluster_lacks_is_named_before_any_work(ray_session, tmp_path):
  from jaxrl_hex.cluster.ray_backend import check_cluster
  from jaxrl_hex.meshes import load_mesh_file
  mesh = tmp_path / "gpu-group.yaml"
  mesh.write_text(open(MIXED_MESH).read().replace("{device_type: cpu, count: 2", "{device_type: gpu, count: 2"))
  with pytest.raises(UserError) as e:
    check_cluster(load_mesh_file(str(mesh)))
  message = str(e.value)
  assert "\n" not in message
  assert "pools.rollout.replicas[1] (gpu x2) needs 2 GPUs but the Ray cluster has no GPU" in message
  check_cluster(load_mesh_file(MIXED_MESH))  # the cpu groups fit


def test_lora_on_ray_sends_the_base_once_and_then_adapters_only(ray_session, warm_workdir, tmp_path):
  """LoRA through the two-process trainer and direct sync: the first publish carries the base's
  manifest (each trainer process its own shards), later ones only the adapters', and the rollout
  runtime's weights are the trainer's adapters on its base, value for value."""
  import ray

  from jaxrl_hex.metrics import Recorder
  from jaxrl_hex.orchestrator import Orchestrator
  cfg = _ray_cfg(warm_workdir, **{"sync.method": "direct", "model.lora.rank": 4, "train.steps": 2})
  workdir = str(tmp_path / "lora")
  rt = build_runtime(cfg)
  train, rollout = ray_sides(rt, workdir, resume=False)
  recorder = Recorder(workdir)
  try:
    Orchestrator(rt, train, rollout, recorder).run()
    handle = train.publish()
    adapters = {k for k in handle.payload}
    assert adapters and all("_lora" in k for k in adapters), "a version moves the adapters alone"
    assert any("['embed']" == k for k in handle.base.payload) and not any("_lora" in k for k in handle.base.payload)
    assert train.publish().base is handle.base  # published once
    worker = rollout.workers[0]
    assert ray.get(worker.receive.remote(handle)) == handle.version
    sent = ray.get([w.fetch_params.remote() for w in train.workers])[0]  # adapters on the base, gathered
    received = ray.get(worker.fetch_params.remote())
    assert jax.tree.structure(sent) == jax.tree.structure(received)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sent), jax.tree.leaves(received)):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train" and "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["kl"] == 0.0
  finally:
    train.close()
    rollout.close()
    recorder.close()


def test_the_tool_task_trains_on_ray_with_tools_in_the_rollout_process(ray_session, calculator_warm, tmp_path):
  """The calculator's episodes on the Ray backend: the engine, the episode threads and the forked
  tool workers live in the rollout actor's process; the batches come back whole, each once."""
  from support_agentic import calculator_config

  from jaxrl_hex import commands
  cfg = calculator_config(
      **{
          "init_from": calculator_warm,
          "mesh_file": RAY_MESH,
          "cluster.backend": "ray",
          "sync.method": "direct",
          "train.steps": 2
      })
  workdir = str(tmp_path / "calc")
  commands.train(cfg, workdir)
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train" and "loss" in r]
  assert [r["step"] for r in rows] == [1, 2] and sorted(r["batch"] for r in rows) == [0, 1]
  for r in rows:
    assert len(r["prompt_ids"]) == 8 and r["episode_tool_calls"] > 0.5 and r["episode_turns"] > 1.5
    assert r["advantage_abs_mean"] > 0
