from jaxrl_hex.data.prompts import PromptStream

RECORDS = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)]


def _indices(batch):
  return [r["index"] for r in batch]


def test_each_epoch_covers_every_record_once_in_a_new_order():
  stream = PromptStream(RECORDS, batch_size=5, seed=0)
  epoch1 = _indices(stream.next()[0]) + _indices(stream.next()[0])
  epoch2 = _indices(stream.next()[0]) + _indices(stream.next()[0])
  assert sorted(epoch1) == sorted(epoch2) == list(range(10))
  assert epoch1 != epoch2


def test_state_after_a_batch_resumes_at_the_next_batch():
  stream = PromptStream(RECORDS, batch_size=3, seed=1)
  stream.next()
  _, state = stream.next()
  expected = [_indices(stream.next()[0]) for _ in range(3)]
  resumed = PromptStream(RECORDS, batch_size=3, seed=1)
  resumed.set_state(state)
  assert [_indices(resumed.next()[0]) for _ in range(3)] == expected


def test_host_shards_are_disjoint():
  a = PromptStream(RECORDS, batch_size=5, seed=0, shard_index=0, shard_count=2)
  b = PromptStream(RECORDS, batch_size=5, seed=0, shard_index=1, shard_count=2)
  assert set(_indices(a.next()[0])).isdisjoint(_indices(b.next()[0]))
