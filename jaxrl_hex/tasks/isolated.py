"""Runs a user's function (a task's reward, an environment's tools) isolated from the run: in
worker processes forked from this one, with a timeout, so that a call that raises, hangs or kills
its process costs that call and never a worker, a thread or the run.

Workers are forked (the function needs no pickling; its arguments and results are pickled through
a pipe) and each runs one call at a time. A call past its timeout cannot be stopped inside a
thread, so its process is killed and replaced, as is a process that died. The function must not
use JAX: a forked child cannot run it.

Several threads may call IsolatedPool.run at once: they share the workers, each taking a free one
per call, so one thread's hung call holds one worker, never the others' calls.
"""
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import typing
import warnings

_POLL_S = 0.02  # how often a run with calls still waiting for a worker looks for one another run freed


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One call's outcome: its value, or an error (one line) and its kind: "raised" (the function
  raised, or its value could not be sent back), "died" (its process exited), "timeout" or "closed"
  (the pool was closed before the call started)."""
  value: typing.Any = None
  error: str | None = None
  kind: str | None = None


def _serve(conn, fn, quiet, parent_end):
  """A worker process: argument tuples in, (value, error) out. It exits when the parent's end of
  its pipe closes, also when the parent is killed: so it must not hold that end itself (a fork
  copies it), or a run killed by SIGKILL leaves its workers behind."""
  parent_end.close()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  if quiet:  # what the function prints would land in the run's console and live panel (which may own sys.stdout)
    sys.stdout = open(os.devnull, "w")  # the process's stdout until it exits
    os.dup2(sys.stdout.fileno(), 1)  # for subprocesses and C code too
  while True:
    try:
      args = conn.recv()
    except (EOFError, OSError):
      return
    try:
      out = (fn(*args), None)
    except BaseException as e:  # noqa: BLE001 -- a user's function: any failure (SystemExit too) is that call's
      out = (None, f"{type(e).__name__}: {e}")
    try:
      conn.send(out)
    except Exception as e:  # noqa: BLE001 -- pickling the value failed; nothing was written
      conn.send((None, f"returned {type(out[0]).__name__}, which cannot be sent back ({type(e).__name__}: {e})"))


class _Worker:

  def __init__(self, fn, name, quiet):
    ctx = multiprocessing.get_context("fork")
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(target=_serve, args=(child, fn, quiet, self.conn), daemon=True, name=name)
    with warnings.catch_warnings():  # JAX warns on every fork; the child runs only the function
      warnings.simplefilter("ignore", RuntimeWarning)
      self.proc.start()
    child.close()
    self.started = 0.0

  def send(self, args):
    self.started = time.monotonic()
    self.conn.send(args)

  def kill(self):
    self.proc.kill()
    self.proc.join()
    self.conn.close()


class IsolatedPool:
  """`workers` processes that run fn(*args) calls; started at the first run. quiet: the workers'
  stdout goes to /dev/null. Iterating gives the workers (each has `proc`, its Process)."""

  def __init__(self, fn: typing.Callable, workers: int, name: str, quiet: bool = False):
    self.fn, self.size, self.name, self.quiet = fn, workers, name, quiet
    self._workers, self._free = [], []
    self._cond = threading.Condition()
    self._generation = 0  # close() counts up: runs begun before it stop starting calls

  def __iter__(self):
    return iter(list(self._workers))

  def __len__(self):
    return len(self._workers)

  def run(self, calls: typing.Sequence[tuple], timeout_s: float) -> list[Outcome]:
    """Each call's Outcome, in order. Calls run in parallel on free workers; one past timeout_s
    has its process killed and replaced."""
    outcomes = [None] * len(calls)
    waiting = list(range(len(calls)))[::-1]  # popped from the end: sent in order
    busy = {}  # conn -> (worker, call index)
    with self._cond:
      generation = self._generation
    while waiting or busy:
      with self._cond:
        while waiting and not (busy or self._free) and self._generation == generation:
          if not self._workers:  # the first run, or the first since close()
            self._workers = [self._fork() for _ in range(self.size)]
            self._free = list(self._workers)
          else:
            self._cond.wait()
        if self._generation != generation:  # closed while this run went on: what has not started never will
          for i in waiting:
            outcomes[i] = Outcome(error="not run: the pool was closed", kind="closed")
          waiting = []
        while waiting and self._free:
          w, i = self._free.pop(), waiting.pop()
          w.send(calls[i])
          busy[w.conn] = (w, i)
      if not busy:
        continue
      wait = min(w.started for w, _ in busy.values()) + timeout_s - time.monotonic()
      if waiting:
        wait = min(wait, _POLL_S)
      for conn in multiprocessing.connection.wait(list(busy), timeout=max(wait, 0.0)):
        w, i = busy.pop(conn)
        try:
          value, error = conn.recv()
        except (EOFError, OSError):  # the process died mid-call (the function killed it, or the OOM killer)
          w.proc.join(1.0)  # its pipe closed as it exited: its exit code follows
          outcomes[i] = Outcome(error=f"its process died (exit code {w.proc.exitcode})", kind="died")
          self._replace(w)
          continue
        outcomes[i] = Outcome(value) if error is None else Outcome(error=error, kind="raised")
        with self._cond:
          self._free.append(w)
          self._cond.notify_all()
      now = time.monotonic()
      for conn, (w, i) in list(busy.items()):
        if now - w.started >= timeout_s:
          del busy[conn]
          outcomes[i] = Outcome(error=f"timed out after {timeout_s}s", kind="timeout")
          self._replace(w)
    return outcomes

  def _fork(self):
    return _Worker(self.fn, self.name, self.quiet)

  def _replace(self, worker):
    worker.kill()
    with self._cond:
      if worker in self._workers:  # else the pool was closed meanwhile
        new = self._fork()
        self._workers[self._workers.index(worker)] = new
        self._free.append(new)
        self._cond.notify_all()

  def close(self):
    """Kills every worker; a later run starts new ones."""
    with self._cond:
      workers, free, self._workers, self._free = self._workers, self._free, [], []
      self._generation += 1
      self._cond.notify_all()
    for w in workers:
      if any(w is f for f in free):
        w.kill()
      else:  # a run in another thread waits on its pipe: it sees the call die and closes the pipe
        w.proc.kill()
