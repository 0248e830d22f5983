"""Where a rollout's time goes, by the profiler: rollout.py's workloads on one device (or its 2 x 2
mesh, --layout 2x2), one warm run of our engine traced (jax.profiler), every XLA:CPU thunk of it
sorted by the HLO instruction it runs,
and the decode limit's chain (rollout.matmul_limit, as many steps) traced the same way, so the
engine's weight matmuls per decode step compare with the chain's in the same process.

What a thunk is, from the compiled programs (XLA_FLAGS=--xla_dump_to, read back by program id),
for the decode loop and the prefill programs alike:
  weight matmuls      dots with a [tokens, features] output (q, k, v, o, gate, up, down, the head)
  attention matmuls   batched dots (q . K, p . V over the cache)
  cache writes        dynamic-update-slices and scatters (a step's KV column and outputs; a
                      prefill's fill of the ring)
  collectives         all-reduces, all-gathers, ... (on a mesh: the tensor-parallel sums, the
                      embedding lookup's, the logits' gather, the loop's flags)
  other ops           the rest: norms, RoPE, softmax, the activation, sampling, layout copies
  between thunks      inside the decode loop, no thunk running: the executor's own time
  decode, per call    a decode program outside its loop: the span's copy of the cache and its
                      write-back, the call's draws
  other programs      the rest (placing requests, sampling keys)
  host                the rest of the run's wall time: Python between calls, dispatch, the
                      programs' own time between thunks outside the decode loop
A thunk's time is its wall time split evenly among the thunks running at once (XLA:CPU runs
independent thunks concurrently; on one core they share it), so the rows add up to the run; a
collective's only while no other thunk runs (a device thread inside one mostly waits for the
other devices' work: with more device threads than cores, that wait is the others' compute), so on
a mesh "collectives" is the time no device computes, the chain's the same way.
Then decode attention alone, written three ways (attention_rates): what a step's reads of the
cache cost against how they are written.

  taskset -c 1 python benchmarks/decode_profile.py [--workloads W1 W2 W5] [--readme]
      ->  benchmarks/out/decode_profile.json
  taskset -c 1 python benchmarks/decode_profile.py --layout 2x2 --readme  ->  .../decode_profile_2x2.json
"""
import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DUMP = os.path.join(tempfile.gettempdir(), f"decode_profile_hlo_{os.getpid()}")  # the programs, as XLA compiles them

OPS = ("weight matmuls", "attention matmuls", "cache writes", "collectives", "other ops")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
CATEGORIES = (*(f"decode loop: {o}" for o in OPS), "decode loop: between thunks", "decode, per call",
              *(f"prefill: {o}" for o in OPS), "other programs", "host")
UNKNOWN = ("?", 0, "?", "", False)  # a thunk missing from the dumps
CONTAINERS = ("while", "conditional", "call")  # thunks whose time is their nested thunks'
# (the partitioner's collectives carry no op_name)
_LINE = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((?:.*?op_name=\"([^\"]*)\")?")

_COMPUTATION = re.compile(r"(?:ENTRY )?%([\w.\-]+) ")
_CALLED = re.compile(r"(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
                     r"\{?((?:%[\w.\-]+(?:, )?)+)")


def _instructions() -> dict:
  """The dumped programs -> {(program id, instruction): (module name, output rank, opcode, op_name,
  whether it lies in a while loop's body or a computation that body calls)}."""
  out = {}
  for path in glob.glob(os.path.join(DUMP, "module_*.cpu_after_optimizations.txt")):
    pid, module = re.match(r"module_(\d+)\.(.+?)\.cpu_after_optimizations", os.path.basename(path)).groups()
    found, computation_of, calls, bodies, dots = {}, {}, collections.defaultdict(set), set(), set()
    computation = None
    for line in open(path):
      if not line.startswith(" "):  # a computation's header (or its closing brace)
        m = _COMPUTATION.match(line)
        computation = m.group(1) if m else computation
        continue
      called = set()
      for key, names in _CALLED.findall(line):  # (a while's output is a tuple: no _LINE match)
        names = set(re.findall(r"%([\w.\-]+)", names))
        called |= names
        if key == "body" and " while(" in line:
          bodies |= names
      calls[computation] |= called
      if " dot(" in line:
        dots.add(computation)
      m = _LINE.match(line)
      if m:
        name, _, dims, opcode, op_name = m.groups()
        found[name] = (module, len(dims.split(",")) if dims else 0, opcode, op_name or "", called)
        computation_of[name] = computation
    in_loop, todo = set(), list(bodies)
    while todo:  # the loop bodies and every computation they call
      c = todo.pop()
      if c not in in_loop:
        in_loop.add(c)
        todo += calls[c]
    for name, (module, rank, opcode, op_name, called) in found.items():
      if opcode == "fusion" and called & dots:  # a fused dot (XLA:CPU's library fusions carry no op_name)
        opcode = "dot"
      out[int(pid), name] = (module, rank, opcode, op_name, computation_of[name] in in_loop)
  return out


def collective(opcode: str) -> bool:
  return opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVES


def category(module: str, rank: int, opcode: str, op_name: str, in_loop: bool = False) -> str:
  """in_loop: the instruction lies in a decode loop's body by the program's structure (what
  tells where the partitioner's collectives, which carry no op_name, run)."""
  program = "prefill" if "prefill" in module else "decode loop" if "decode" in module else None
  if program is None:
    return "other programs"
  if program == "decode loop" and "/while/body/" not in op_name and not in_loop:
    return "decode, per call"
  if collective(opcode):
    return f"{program}: collectives"
  op = op_name.rsplit("/", 1)[-1]
  if op == "dot_general" or opcode == "dot":
    return f"{program}: {'weight' if rank == 2 else 'attention'} matmuls"
  return f"{program}: {'cache writes' if op in ('dynamic_update_slice', 'scatter') else 'other ops'}"


def traced(run) -> tuple[float, list, list]:
  """run() once under the profiler -> (its wall seconds, [(start ns, end ns, program id, op)] of
  the leaf thunks it ran, [(start ns, end ns)] of the decode loops it ran)."""
  import jax
  from jax._src.profiler import ProfileData
  trace = tempfile.mkdtemp(prefix="decode_profile_trace_")
  jax.profiler.start_trace(trace)
  t0 = time.perf_counter()
  run()
  wall = time.perf_counter() - t0
  jax.profiler.stop_trace()
  data = ProfileData.from_file(sorted(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True))[-1])
  shutil.rmtree(trace)
  thunks, loops = [], []
  for plane in data.planes:
    for line in plane.lines:
      for ev in line.events:
        stats = dict(ev.stats)
        if "hlo_op" not in stats:
          continue
        if not stats["hlo_op"].startswith(CONTAINERS):
          thunks.append((ev.start_ns, ev.start_ns + ev.duration_ns, int(stats["program_id"]), stats["hlo_op"]))
        elif stats["hlo_op"].startswith("while") and "decode" in stats.get("hlo_module", ""):
          loops.append((ev.start_ns, ev.start_ns + ev.duration_ns))
  return wall, thunks, loops


def idle_within(spans, thunks) -> float:
  """Seconds inside `spans` [(start, end) ns] while none of `thunks` runs: the executor's own time
  between them."""
  edges = sorted([(a, 0, 1) for a, _ in spans] + [(b, 0, -1) for _, b in spans] + [(t[0], 1, 1) for t in thunks] +
                 [(t[1], 1, -1) for t in thunks])
  depth, idle, last = [0, 0], 0, None
  for t, which, step in edges:
    if last is not None and depth[0] and not depth[1]:
      idle += t - last
    depth[which] += step
    last = t
  return idle / 1e9


def shares(thunks, waiting=frozenset()) -> dict:
  """Each thunk's seconds, its wall time split evenly among the thunks running at once -> {thunk
  index: seconds}. waiting: thunks (collectives, on a mesh) that get a share only while nothing
  else runs: a device's thread inside a collective mostly waits for the other devices' work, so
  on a mesh of more device threads than cores they count only as the time no device computes."""
  edges = sorted([(s, 1, k) for k, (s, *_) in enumerate(thunks)] + [(e, -1, k) for k, (_, e, *_) in enumerate(thunks)])
  running, out, last = set(), collections.Counter(), None
  for t, kind, k in edges:
    working = running - waiting or running
    if working and last is not None:
      for j in working:
        out[j] += (t - last) / len(working) / 1e9
    last = t
    (running.add if kind == 1 else running.discard)(k)
  return out


def profile(workload: str, rounds: int, top: int = 0, layout: str = "1") -> dict:
  """workload's run and the chains traced `rounds` times, the fastest of each kept -> its seconds
  by category (top: print its slowest thunks)."""
  import rollout  # benchmarks/ is on the path when run as a script
  w = rollout.workload(workload)
  pool, policy, params = rollout._our_policy(layout)
  engine = rollout.our_engine(w, pool, policy, params)
  tokens = rollout.run_workload(engine, w, 0)  # compiles
  steps, cached = engine.decode_steps, engine.prefill_tokens - len(w["prompts"])  # as rollout.py counts them
  chains = [
      rollout.matmul_limit(policy, pool, params, w["slots"], steps),
      rollout.matmul_limit(policy, pool, params, w["slots"], steps, cached=cached)
  ]
  for seed in (1, 2):  # warm
    rollout.run_workload(engine, w, seed)
    for chain in chains:
      chain()
  fastest = lambda run: min((traced(run) for _ in range(rounds)), key=lambda got: got[0])
  wall, thunks, loops = fastest(lambda: rollout.run_workload(engine, w, 3))
  (chain_wall, chain_thunks, _), (_, prefill_thunks, _) = map(fastest, chains)
  hlo = _instructions()
  own_shares = lambda thunks: shares(
      thunks, frozenset(k for k, t in enumerate(thunks) if collective(hlo.get(t[2:], UNKNOWN)[2])))
  seconds, own = collections.Counter(), own_shares(thunks)
  for k, s in own.items():
    _, _, pid, op = thunks[k]
    seconds[category(*hlo.get((pid, op), UNKNOWN))] += s
  seconds["decode loop: between thunks"] = idle_within(loops, thunks)
  seconds["host"] = max(wall - sum(seconds.values()), 0.0)
  # the chains' weight matmuls: their programs' dots with a [tokens, features] output
  is_matmul = lambda _, rank, opcode, op_name, ___: rank == 2 and (opcode == "dot" or op_name.endswith("dot_general"))
  is_collective = lambda _, __, opcode, ___, ____: collective(opcode)
  summed = lambda thunks, split, which: sum(sec for k, sec in split.items() if which(*hlo.get(thunks[k][2:], UNKNOWN)))
  chain_split = own_shares(chain_thunks)
  chain_dots = summed(chain_thunks, chain_split, is_matmul)
  prefill_dots = summed(prefill_thunks, own_shares(prefill_thunks), is_matmul)
  if top:
    slowest = collections.Counter()
    for k, sec in own.items():
      slowest[thunks[k][2:]] += sec
    for (pid, op), sec in slowest.most_common(top):
      info = hlo.get((pid, op), UNKNOWN)
      print(f"{sec * 1e3:8.2f} ms  {category(*info):32s} {info[0]:14s} {op:40s} {info[3][-50:]}")
  return dict(workload=workload, layout=layout, run_s=wall, new_tokens=tokens, decode_steps=steps,
              seconds={c: seconds[c] for c in CATEGORIES}, chain_s=chain_wall, chain_matmul_s=chain_dots,
              chain_collectives_s=summed(chain_thunks, chain_split, is_collective),
              matmuls_over_chain=seconds["decode loop: weight matmuls"] / chain_dots,
              prefill_chain_matmul_s=prefill_dots,
              prefill_matmuls_over_chain=seconds["prefill: weight matmuls"] / prefill_dots)


def attention_rates(rounds: int, rows=64, kv=2, group=2, head_dim=64, steps=64) -> list:
  """Decode attention alone (W2's shapes: rows x KV heads x queries per KV head x head_dim, the
  cache laid out as the engine's flat one) over 48 / 96 / 288 columns, written three ways, `steps`
  steps in one jitted loop -> [{columns, way: GB/s of cache read}] (the best of `rounds`)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  dot = lambda q, k, v: jnp.matmul(jax.nn.softmax(jnp.matmul(q, k), -1), v)  # as models/decoder.py
  sums = lambda q, k, v: (jax.nn.softmax((q[..., None] * k[:, :, None]).sum(-2), -1)[..., None] * v[:, :, None]).sum(-2)
  mixed = lambda q, k, v: jnp.matmul(jax.nn.softmax((q[..., None] * k[:, :, None]).sum(-2), -1), v)
  ways = {"batched matmuls": dot, "multiplies and sums": sums, "sums, then a matmul": mixed}

  def loop(f):  # steps of f in one program, each step's output feeding the next one's queries
    return jax.jit(lambda q, keys, values: jax.lax.fori_loop(0, steps, lambda i, q: q + 1e-3 * f(q, keys, values), q))

  runs = {name: loop(f) for name, f in ways.items()}
  out = []
  for columns in (48, 96, 288):
    rng = np.random.default_rng(0)
    k, v, q = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((rows, kv, head_dim, columns), (rows, kv, columns, head_dim), (rows, kv, group, head_dim)))
    for run in runs.values():
      np.testing.assert_allclose(run(q, k, v), runs["batched matmuls"](q, k, v), rtol=1e-4, atol=1e-4)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
      for name, run in runs.items():
        t0 = time.perf_counter()
        run(q, k, v).block_until_ready()
        best[name] = min(best[name], time.perf_counter() - t0)
    read = 2 * rows * kv * columns * head_dim * 4 * steps  # keys and values, fp32, every step
    out.append(dict(columns=columns, **{name: read / t / 1e9 for name, t in best.items()}))
  return out


def table(rows, attention) -> str:
  head = "| part of a run | " + " | ".join(f"{r['workload']} ms | share" for r in rows) + " |"
  lines = [head, "|---|" + "---|---|" * len(rows)]
  for c in CATEGORIES:
    lines.append(f"| {c} | " +
                 " | ".join(f"{r['seconds'][c] * 1e3:.1f} | {r['seconds'][c] / r['run_s']:.0%}" for r in rows) + " |")
  lines.append("| **run** | " + " | ".join(f"**{r['run_s'] * 1e3:.1f}** | {r['decode_steps']} steps" for r in rows) +
               " |")
  lines.append("| the limit's chain (as many steps) | " +
               " | ".join(f"{r['chain_s'] * 1e3:.1f} | {r['chain_s'] / r['run_s']:.2f} of the run" for r in rows) +
               " |")
  lines.append("| decode loop's weight matmuls, ours / the chain's | " +
               " | ".join(f"**{r['matmuls_over_chain']:.2f}x** | " for r in rows) + " |")
  lines.append("| prefill's weight matmuls, ours / the prefill chain's | " +
               " | ".join(f"**{r['prefill_matmuls_over_chain']:.2f}x** | " for r in rows) + " |")
  if rows[0]["layout"] != "1":
    lines.append("| the chain's collectives | " + " | ".join(
        f"{r['chain_collectives_s'] * 1e3:.1f} | {r['chain_collectives_s'] / r['chain_s']:.0%} of the chain"
        for r in rows) + " |")
  if not attention:
    return "\n".join(lines)
  ways = [k for k in attention[0] if k != "columns"]
  lines += [
      "", "| decode attention alone, cache columns | " + " | ".join(f"{w}, GB/s" for w in ways) + " |",
      "|---|" + "---|" * len(ways)
  ]
  lines += [f"| {a['columns']} | " + " | ".join(f"{a[w]:.1f}" for w in ways) + " |" for a in attention]
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workloads", nargs="+", default=["W1", "W2", "W5"], choices=("W1", "W2", "W5"))
  ap.add_argument("--rounds", type=int, default=3, help="traced runs of each, the fastest kept")
  ap.add_argument("--top", type=int, default=0, help="print each run's slowest thunks")
  ap.add_argument("--layout", default="1", choices=("1", "2x2"),
                  help="the rollout pool: one device, or data 2 x tensor 2 on 4 simulated CPU devices (rollout.py's)")
  ap.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
  args = ap.parse_args()
  import rollout
  if args.layout != "1":
    from jaxrl_hex.meshes import prepare_cpu_devices
    prepare_cpu_devices(rollout.device_count(args.layout))
  try:
    rows = [profile(w, args.rounds, args.top, args.layout) for w in args.workloads]
    attention = attention_rates(2 * args.rounds + 1) if args.layout == "1" else []
  finally:
    shutil.rmtree(DUMP, ignore_errors=True)
  from readme_section import report
  suffix = "" if args.layout == "1" else f"_{args.layout}"
  report(os.path.join(HERE, "out", f"decode_profile{suffix}.json"), dict(runs=rows, attention=attention),
         table(rows, attention), args.readme, f"decode-profile{suffix.replace('_', '-')}",
         f"Where a rollout's time goes{suffix.replace('_', ', ')} (benchmarks/decode_profile.py)")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"  # before JAX starts
  sys.exit(main())
