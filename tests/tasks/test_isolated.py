"""The forked worker pool behind rewards and tools: workers do not outlive their parent."""
import signal
import subprocess
import sys
import textwrap
import time

from support import ROOT

POOL = textwrap.dedent("""
  import time
  from jaxrl_hex.tasks.isolated import IsolatedPool
  pool = IsolatedPool(lambda x: x + 1, 3, "t")
  print(pool.run([(1,)], 5.0)[0].value, flush=True)
  time.sleep(60)
""")


def _alive(pid: str) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"
  except FileNotFoundError:
    return False


def test_workers_exit_when_their_parent_is_killed():
  """A run killed by SIGKILL (a lost train process) leaves no workers behind: each worker's pipe
  closes with the parent, because no worker holds the parent's end of its own pipe."""
  parent = subprocess.Popen([sys.executable, "-c", POOL], stdout=subprocess.PIPE, text=True, cwd=ROOT)
  assert parent.stdout.readline().strip() == "2"
  workers = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()
  assert len(workers) == 3
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.time() + 10
  while any(_alive(w) for w in workers) and time.time() < deadline:
    time.sleep(0.1)
  assert not [w for w in workers if _alive(w)]
