"""The rollout router on a simulated fleet (a virtual clock, no Ray, no JAX)."""
import heapq
import threading

import pytest

from jaxrl_hex.cluster.router import Router, RouterClosed

TOKENS = 10  # tokens a prompt group generates in the simulation


class Fleet:
  """Replicas generating at `speeds` tokens/s on a virtual clock; batches of `size` groups are
  admitted `in_flight` at a time, in order, as the orchestrator's gate does. With `capacity`
  (groups an engine runs at once) a chunk takes one wave, however many groups it has (a ring
  engine's step computes every slot), and a replica with free capacity asks again at once;
  without, a chunk's time grows with its groups and only an idle replica asks."""

  def __init__(self, speeds, shares=None, pieces=1, lose=(), capacity=None, first=0.0):
    self.now = 0.0
    self.first = first  # seconds a replica's first chunk takes on top (first-run costs)
    self.speeds = list(speeds)
    self.capacity = capacity
    self.router = Router(len(speeds), shares, pieces=pieces, clock=lambda: self.now, capacity=capacity)
    self.lose = set(lose)  # (replica, n-th chunk it takes): that chunk's replica is lost mid-way
    self.chunks = []  # every chunk handed out, in order
    self.finished = []  # batch keys in the order they completed
    self.results = {}
    self.stats = {}

  def run(self, batches, in_flight=2):
    pending, events, idle, taken = list(enumerate(batches)), [], set(range(len(self.speeds))), {}
    admitted = []
    while pending or admitted:
      while pending and len(admitted) < in_flight:
        k, groups = pending.pop(0)
        self.router.add_batch(k, groups, context=("ctx", k))
        admitted.append(k)
      asking = sorted(idle) if self.capacity is None else list(range(len(self.speeds)))
      for r in asking:
        chunk = self.router.next_chunk(r, timeout=0)
        if chunk is None:
          continue
        idle.discard(r)
        if self.capacity is not None:
          asking.append(r)  # its free capacity may take more
        self.chunks.append(chunk)
        n = taken[r] = taken.get(r, 0) + 1
        waves = 1 if self.capacity is not None else len(chunk.groups)
        seconds = waves * TOKENS / self.speeds[r] + (self.first if n == 1 else 0.0)
        lost = (r, n) in self.lose
        heapq.heappush(events, (self.now + (seconds / 2 if lost else seconds), len(self.chunks), chunk, lost))
        if self.capacity is not None:  # an engine never holds more groups than it runs at once
          assert sum(len(c.groups) for _, _, c, _ in events if c.replica == r) <= self.capacity[r]
      self.now, _, chunk, lost = heapq.heappop(events)
      idle.add(chunk.replica)
      if lost:
        self.router.give_back(chunk)
      else:
        tokens = len(chunk.groups) * TOKENS
        self.router.measure(chunk.replica, tokens, tokens / self.speeds[chunk.replica])
        self.router.finish(chunk, [g for g in chunk.groups], tokens)
      for k in list(admitted):
        try:
          self.results[k], self.stats[k] = self.router.wait(k, timeout=0)
        except TimeoutError:
          continue
        admitted.remove(k)
        self.finished.append(k)
    return self


def _batches(n_batches, size):
  return [[f"b{k}p{i}" for i in range(size)] for k in range(n_batches)]


def _check_exactly_once(fleet, batches):
  for k, groups in enumerate(batches):
    positions = [p for ps, _ in fleet.results[k] for p in ps]
    assert sorted(positions) == list(range(len(groups))), f"batch {k}: {sorted(positions)}"
    for ps, result in fleet.results[k]:  # each chunk's result is its groups, whole and in place
      assert result == [groups[p] for p in ps]


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_every_group_once_and_whole_under_work_stealing(pieces):
  batches = _batches(6, 12)
  fleet = Fleet([1.0, 4.0, 4.0], pieces=pieces).run(batches)  # equal priors, very unequal speeds
  _check_exactly_once(fleet, batches)
  assert all(len(c.groups) == len(c.positions) >= 1 for c in fleet.chunks)
  # the fast replicas took more than their equal allotment of some batch: they stole from the slow one
  per_batch = {}
  for c in fleet.chunks:
    per_batch.setdefault((c.batch, c.replica), 0)
    per_batch[c.batch, c.replica] += len(c.groups)
  assert max(per_batch[k, 1] for k in range(6)) > 12 / 3


@pytest.mark.parametrize("capacity", [None, [3, 3, 3]])
def test_lost_replica_chunk_goes_back_to_the_front_and_nothing_is_lost_or_repeated(capacity):
  batches = _batches(4, 9)
  fleet = Fleet([2.0, 2.0, 1.0], lose={(0, 1), (2, 2)}, capacity=capacity).run(batches)
  _check_exactly_once(fleet, batches)
  first = fleet.chunks[0]
  assert first.replica == 0 and first.batch == 0
  # the lost chunk's groups were handed out again, before any group after them
  again = next(c for c in fleet.chunks[3:] if set(c.positions) & set(first.positions) and c.batch == 0)
  assert again.positions[0] == first.positions[0]
  assert sum(fleet.router.stats[r]["prompts"] for r in range(3)) == 4 * 9


def test_waves_go_to_the_replica_where_they_finish_first():
  # a replica 1.8x as fast as the other, engines of 4 groups each, batches of 16 groups, one in flight
  fast, slow = TOKENS / 1.8, TOKENS / 1.0  # seconds of a wave
  batches = _batches(5, 16)
  fleet = Fleet([1.0, 1.8], capacity=[4, 4]).run(batches, in_flight=1)
  _check_exactly_once(fleet, batches)
  assert fleet.router.chunk_s == pytest.approx([slow, fast])
  for k in range(1, 5):  # once both waves are measured
    # the slow replica runs one wave and leaves the last 4 groups to the fast one's third wave: the
    # share split (about 6 groups there) would wait for its second wave, and 20 s instead of 16.7
    assert [r["prompts"] for r in fleet.stats[k]["replicas"]] == [4, 12]
    assert fleet.stats[k]["seconds"] == pytest.approx(3 * fast)
    assert fleet.stats[k]["replicas"][1]["idle_s"] == pytest.approx(0)


def test_a_replicas_slow_first_chunk_does_not_skew_the_schedule():
  # each replica's first wave takes half a slow wave longer (first-run costs: allocations, the first
  # weights); an average seeded with it rated the fast replica too slow for the batch after the warm-up
  # one, and the slow replica took 8 of its groups (two waves, 20 s instead of 18.75)
  fast, slow = TOKENS / 1.6, TOKENS / 1.0
  batches = _batches(4, 16)
  fleet = Fleet([1.0, 1.6], capacity=[4, 4], first=slow / 2).run(batches, in_flight=1)
  _check_exactly_once(fleet, batches)
  for k in range(1, 4):  # from the first batch after the warm-up one
    assert [r["prompts"] for r in fleet.stats[k]["replicas"]] == [4, 12], k
    assert fleet.stats[k]["seconds"] == pytest.approx(3 * fast)
  assert fleet.router.chunk_s == pytest.approx([slow, fast])


def _settle(router, clock, seconds):
  """Two batches of one wave per replica, a wave taking seconds[r] on replica r: every replica has
  finished two chunks (its estimate settled), so earliest finish routes from here on."""
  for _ in range(2):
    start = clock[0]
    router.add_batch(("warm", start), list(range(sum(router.capacity))))
    chunks = [router.next_chunk(r, timeout=0) for r in range(router.replicas)]  # equal shares: a wave each
    for r in sorted(range(router.replicas), key=lambda r: seconds[r]):
      clock[0] = start + seconds[r]
      router.finish(chunks[r], None, tokens=10)
    router.wait(("warm", start), timeout=0)
  assert router.chunk_s == seconds


def test_estimates_settle_after_two_chunks_and_only_then_route_by_earliest_finish():
  clock = [0.0]
  router = Router(2, capacity=[4, 4], clock=lambda: clock[0])
  router.add_batch(0, list(range(8)))
  first = [router.next_chunk(r, timeout=0) for r in (0, 1)]
  clock[0] = 1.0
  router.finish(first[1], None, tokens=10)
  clock[0] = 9.0
  router.finish(first[0], None, tokens=10)  # replica 0's first chunk: 8 s of first-run costs on top
  router.wait(0, timeout=0)
  router.add_batch(1, list(range(8)))
  # one chunk each is not enough to go by: rated 9 s against 1 s, replica 0 would be given nothing,
  # so never a chunk that shows its real speed; the shares give it its half
  second = [router.next_chunk(r, timeout=0) for r in (0, 1)]
  assert [len(c.groups) for c in second] == [4, 4]
  clock[0] = 9.4
  router.finish(second[1], None, tokens=10)
  clock[0] = 10.0
  router.finish(second[0], None, tokens=10)
  router.wait(1, timeout=0)
  assert router.chunk_s == pytest.approx([1.0, 0.4])  # the second chunks' seconds, not averages with the first
  router.add_batch(2, list(range(8)))  # settled: two waves of replica 1 (0.8 s) beat one of replica 0's
  assert router.next_chunk(0, timeout=0) is None
  assert len(router.next_chunk(1, timeout=0).groups) == 4


def test_a_chunk_due_by_now_keeps_its_slots_until_it_finishes():
  clock = [0.0]
  router = Router(2, capacity=[4, 4], clock=lambda: clock[0])
  _settle(router, clock, [1.0, 1.0])
  t0 = clock[0]
  router.add_batch(0, list(range(8)))
  a, b = router.next_chunk(0, most=2, timeout=0), router.next_chunk(0, most=2, timeout=0)
  c = router.next_chunk(1, timeout=0)
  clock[0] = t0 + 1.0
  router.finish(c, None, tokens=40)
  router.finish(a, None, tokens=20)  # chunk seconds stay [1, 1]: b, started with a, is due now and still runs
  router.add_batch(1, list(range(8)))
  clock[0] = t0 + 1.5
  top_up = router.next_chunk(0, most=2, timeout=0)  # the two slots a freed, not b's as well
  assert (len(a.groups), len(b.groups), len(c.groups), len(top_up.groups)) == (2, 2, 4, 2)
  assert len(router.next_chunk(1, timeout=0).groups) == 4


def test_a_finish_into_a_failed_batch_wakes_a_replica_the_schedule_now_gives_work():
  clock = [0.0]
  router = Router(2, capacity=[4, 4], clock=lambda: clock[0])
  _settle(router, clock, [3.0, 1.0])  # a wave takes 3 s on replica 0, 1 s on replica 1
  t0 = clock[0]
  router.add_batch("x", list(range(4)))
  x = router.next_chunk(1, timeout=0)
  router.fail("x", ValueError("reward crashed"))  # x's chunk still runs on replica 1
  router.add_batch("y", list(range(4)))  # replica 1's next wave finishes it first (in 2 s, not 3)
  got = []
  idle = threading.Thread(target=lambda: got.append(router.next_chunk(0)))
  idle.start()
  while 0 not in router._waiting and idle.is_alive():  # replica 0 declined y and waits
    idle.join(timeout=0.001)
  clock[0] = t0 + 10.0
  router.finish(x, None, tokens=40)  # x ran 10 s: replica 1's chunk seconds 5.5, so y is replica 0's now
  try:
    idle.join(timeout=5)
    assert not idle.is_alive() and got[0].batch == "y" and len(got[0].groups) == 4
  finally:
    router.close()
    idle.join(timeout=5)


def test_shares_follow_measured_speed_from_the_planner_prior():
  fleet = Fleet([1.0, 2.0, 3.0], shares=[0.5, 0.25, 0.25])
  assert fleet.router.shares() == pytest.approx([0.5, 0.25, 0.25])
  fleet.run(_batches(8, 12), in_flight=1)
  assert fleet.router.shares() == pytest.approx([1 / 6, 2 / 6, 3 / 6], rel=1e-6)
  # once the shares are right the replicas finish a batch together: little idle time per batch
  last = fleet.stats[7]
  assert [r["prompts"] for r in last["replicas"]] == [2, 4, 6]
  assert all(r["idle_s"] <= 0.1 * last["seconds"] + 1e-9 for r in last["replicas"])


def test_unmeasured_replicas_keep_their_prior_in_measured_units():
  router = Router(2, shares=[3, 1])
  router.add_batch(0, ["a", "b", "c", "d"])
  chunk = router.next_chunk(1, timeout=0)
  assert len(chunk.groups) == 1  # a quarter of the batch
  router.finish(chunk, None, tokens=100)
  router.measure(1, tokens=100, seconds=1.0)
  assert router.shares() == pytest.approx([0.75, 0.25])  # replica 0 unmeasured: prior scaled to replica 1's rate


def test_batches_start_and_complete_in_order():
  batches = _batches(5, 6)
  fleet = Fleet([3.0, 3.0, 3.0]).run(batches, in_flight=3)
  _check_exactly_once(fleet, batches)
  assert fleet.finished == list(range(5))
  started = [c.batch for c in fleet.chunks]
  assert started == sorted(started)  # no group of batch k+1 starts while batch k has unstarted ones


def test_idle_time_is_recorded_for_a_fast_replica_waiting_on_a_slow_one():
  router_fleet = Fleet([1.0, 10.0]).run(_batches(1, 2), in_flight=1)  # one group each: the fast one waits
  fast, slow = router_fleet.stats[0]["replicas"][1], router_fleet.stats[0]["replicas"][0]
  assert fast["prompts"] == slow["prompts"] == 1
  assert fast["idle_s"] == pytest.approx(10 - 1)
  assert slow["idle_s"] == pytest.approx(0)
  assert router_fleet.router.stats[1]["busy_s"] == pytest.approx(1)


def test_threads_fail_and_close_wake_every_waiter():
  router = Router(2)
  router.add_batch("a", [1, 2])
  router.add_batch("b", [3])
  got = []

  def replica(r):
    while True:
      chunk = router.next_chunk(r)
      if chunk is None:
        return
      got.append(chunk)
      if chunk.batch == "a":
        router.fail("a", ValueError("reward crashed"))

  threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
  for t in threads:
    t.start()
  with pytest.raises(ValueError, match="reward crashed"):
    router.wait("a", timeout=10)
  router.close()
  with pytest.raises(RouterClosed):
    router.wait("b", timeout=10)
  for t in threads:
    t.join(timeout=10)
    assert not t.is_alive()


def test_a_replica_holding_several_chunks_tops_up_within_its_room_and_is_busy_once():
  clock = [0.0]
  router = Router(2, clock=lambda: clock[0])
  router.add_batch(0, list(range(6)))  # equal shares: 3 groups each
  a = router.next_chunk(0, most=2, timeout=0)  # its engine has room for 2
  clock[0] = 1.0
  b = router.next_chunk(0, most=5, timeout=0)  # topping up while it holds a: the rest of its allotment
  assert (len(a.groups), len(b.groups)) == (2, 1) and a.id != b.id
  clock[0] = 4.0
  router.finish(a, None, tokens=20)
  clock[0] = 5.0
  router.finish(b, None, tokens=10)
  assert router.stats[0]["busy_s"] == 5.0 and router.stats[0]["idle_s"] == 0.0  # [0, 5] once, not 4 + 4
  router.measure(0, tokens=30, seconds=0.0)  # a call that only compiled: no measure
  router.measure(1, tokens=0, seconds=2.0)
  assert router.rate == [None, None]
  router.measure(0, tokens=30, seconds=5.0)
  router.measure(0, tokens=60, seconds=5.0)
  assert router.rate == [pytest.approx(0.5 * 12 + 0.5 * 6), None]
  rest = router.next_chunk(1, timeout=0)
  clock[0] = 7.0
  router.finish(rest, None, tokens=30)
  results, stats = router.wait(0, timeout=0)
  assert [r["busy_s"] for r in stats["replicas"]] == [5.0, 2.0]
  assert [r["idle_s"] for r in stats["replicas"]] == [2.0, 5.0]


def test_a_lost_replica_holding_several_chunks_gives_them_all_back_and_is_not_counted_on():
  clock = [0.0]
  router = Router(2, clock=lambda: clock[0], capacity=[4, 4])
  _settle(router, clock, [1.0, 2.0])  # replica 0 the faster
  router.add_batch(1, list(range(6)))
  a = router.next_chunk(0, most=2, timeout=0)
  b = router.next_chunk(0, most=2, timeout=0)
  assert (len(a.groups), len(b.groups)) == (2, 2)
  router.give_back(a)  # replica 0 is lost with both chunks
  router.give_back(b)
  assert [router._free(q) for q in (0, 1)] == [4, 4] and router._open[0] == {}  # nothing held
  # replica 1 does not leave groups to the lost (faster) replica's free slots: it takes all it can start
  c = router.next_chunk(1, timeout=0)
  assert sorted(c.positions) == [0, 1, 2, 3]  # the given-back groups first
  d = router.next_chunk(0, timeout=0)  # the replacement asks: the rest
  assert d.positions == [4, 5]
  clock[0] = 3.0
  router.finish(c, None, tokens=40)
  router.finish(d, None, tokens=20)
  results, _ = router.wait(1, timeout=0)
  assert sorted(p for ps, _ in results for p in ps) == list(range(6))
