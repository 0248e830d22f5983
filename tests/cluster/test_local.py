import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from support import SMALL, load_config

from jaxrl_hex.cluster.local import LocalRolloutSide, make_syncs
from jaxrl_hex.runtime import build_runtime


def test_the_engine_decodes_on_version_n_while_n_plus_1_lands_and_each_token_records_its_version(tmp_path):
  cfg = load_config(**SMALL, **{"rollout.max_new_tokens": 24, "rollout.steps_per_sync": 2})
  rt = build_runtime(cfg)
  sync, base_sync = make_syncs(rt, str(tmp_path), receive=True)
  side = LocalRolloutSide(rt, sync, base_sync)
  engine = side.engine
  train = rt.shardings("train")
  side.refresh(engine, sync.publish(1, rt.policy.init(1, train)))
  # version 2: all-zero weights, so every logit is 0 and every token sampled with them has logprob
  # -log(vocab); version 1's never do
  uniform = -math.log(rt.policy.cfg.vocab_size)
  receive, gate, during = sync.receive, threading.Event(), {}

  def slow_receive(handle):  # version 2 lands only once the engine has decoded on version 1
    if handle.version == 2 and not gate.wait(60):
      raise TimeoutError("the engine decoded no steps while version 2 was being received")
    return receive(handle)

  sync.receive = slow_receive

  def release():
    deadline = time.time() + 60
    while engine.decode_steps < start_steps + 4 and time.time() < deadline:
      time.sleep(0.001)
    during.update(steps=engine.decode_steps, version=engine.version)
    gate.set()

  start_steps = engine.decode_steps
  watcher = threading.Thread(target=release)
  watcher.start()
  side.offer(sync.publish(2, jax.tree.map(jnp.zeros_like, rt.policy.init(1, train))))
  rollout = engine.generate([r["prompt"] for r in rt.task.train[:8]], 4, jax.random.key(0))
  watcher.join()
  side._wait_landing(2)
  # the engine went on decoding on version 1 while version 2 was being received
  assert during["version"] == 1 and during["steps"] >= start_steps + 4
  mask = rollout.completion_mask.astype(bool)
  versions, logp = rollout.versions[mask], rollout.behaviour_logprobs[mask]
  assert set(np.unique(versions)) == {1, 2}  # it switched mid-generation
  np.testing.assert_allclose(logp[versions == 2], uniform, atol=1e-5)
  assert np.all(np.abs(logp[versions == 1] - uniform) > 1e-5)
  # within a sample the versions never go back
  assert np.all(np.diff(np.where(rollout.completion_mask, rollout.versions, 2), axis=1) >= 0)
  side.close()
