"""Chunks streamed through one running engine: the same samples as one generate() of the batch."""
import jax
import numpy as np
import pytest

from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rollout.engine import Engine
from jaxrl_hex.rollout.stream import ChunkStream

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=True)
TOK = CharTokenizer("0123456789+=")
PROMPTS = ["12+34=", "7=", "99+1=", "3+3=", "5+50=", "8+1="]
GROUP = 2


@pytest.fixture(scope="module")
def setup(pools):
  policy = Policy.build(CFG)
  params = policy.init(0, pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()))

  def engine():
    e = Engine(policy, pools["rollout"], TOK, 10, temperature=1.3, slots=4, max_prompt_len=16, eos_ids=(99,),
               steps_per_sync=4)
    e.load_weights(0, params)
    return e

  return engine


def _drain(stream):
  done = {}
  while len(stream):
    done.update(stream.advance())
  return done


def test_split_and_interleaved_chunks_draw_the_samples_of_one_generate(setup):
  rng = jax.random.key(5)
  whole = setup().generate(PROMPTS, GROUP, rng, group_ids=list(range(10, 16)))
  stream = ChunkStream(setup())
  stream.submit("a", PROMPTS[:1], GROUP, rng, [10])
  stream.submit("other", ["1+1="], GROUP, jax.random.key(9), [0])  # another batch shares the decode steps
  done = dict(stream.advance())  # chunks submitted while others decode
  stream.submit("b", PROMPTS[3:], GROUP, rng, [13, 14, 15])
  stream.submit("c", PROMPTS[1:3], GROUP, rng, [11, 12])
  assert done == {} and stream.rows == 14  # 4 of 10 tokens each: nothing finished yet
  done.update(_drain(stream))
  assert set(done) == {"a", "b", "c", "other"} and stream.rows == 0
  parts = [done[k] for k in "acb"]
  np.testing.assert_array_equal(np.concatenate([p.group_ids for p in parts]), whole.group_ids)
  np.testing.assert_array_equal(np.concatenate([p.completion for p in parts]), whole.completion)
  np.testing.assert_allclose(np.concatenate([p.behaviour_logprobs for p in parts]), whole.behaviour_logprobs, rtol=1e-5,
                             atol=1e-6)
  # a group's two samples are drawn from different keys
  assert any((whole.completion[i] != whole.completion[i + 1]).any() for i in range(0, 12, 2))


def test_a_chunk_comes_back_once_every_sample_of_it_is_done_and_only_once(setup):
  stream = ChunkStream(setup())
  stream.submit(0, PROMPTS[:3], GROUP, jax.random.key(1))  # 6 samples on 4 slots: two rounds
  seen = []
  while len(stream):
    out = stream.advance()
    seen += [k for k, _ in out]
    if not seen:
      assert stream.rows > 0
  assert seen == [0] and stream.advance() == []
  with pytest.raises(ValueError, match="already in the stream"):
    stream.submit(1, PROMPTS[:1], GROUP, jax.random.key(1))
    stream.submit(1, PROMPTS[:1], GROUP, jax.random.key(1))


def test_after_warmup_a_stream_of_any_split_compiles_nothing(setup):
  engine = setup()
  seconds = engine.warmup([len(TOK.encode(p)) + 1 for p in PROMPTS], GROUP)  # + BOS
  compiled = engine.compile_count
  assert seconds > 0 and compiled >= 3  # prefill buckets of 1 and 2 prompts, decode spans
  stream = ChunkStream(engine)
  for k, part in enumerate([PROMPTS[:1], PROMPTS[1:3], PROMPTS[3:4], PROMPTS[4:]]):
    stream.submit(k, part, GROUP, jax.random.key(k))
    stream.advance()
  _drain(stream)
  assert engine.compile_count == compiled


def test_arrived_work_ends_a_long_advance_at_the_next_hand_back(setup):
  """A routed replica's call runs hand-backs for up to max_s; work that arrives for it elsewhere
  (arrived()) ends the call after the hand-back in progress, so the caller can queue it."""
  engine = setup()
  stream = ChunkStream(engine)
  stream.submit(0, PROMPTS[:2], GROUP, jax.random.key(1))  # 4 samples on 4 slots: full, nothing queued
  steps = engine.decode_steps
  assert stream.advance(max_s=60.0, group_size=GROUP, arrived=lambda: True) == []
  assert engine.decode_steps - steps == engine.steps_per_sync  # one hand-back, not 60 s of them
  steps = engine.decode_steps
  done = stream.advance(max_s=60.0, group_size=GROUP)  # nothing arrives: on until the chunk is done
  assert [k for k, _ in done] == [0] and engine.decode_steps - steps > engine.steps_per_sync
