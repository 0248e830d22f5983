"""Host memory for XLA:CPU (JAXRL_HEX_MALLOC=system|huge|keep): how a program's temporaries get pages.

XLA:CPU takes every buffer of a program from glibc's malloc, and a program's temporaries from one
block per call (a W3 train step's: 897 MB). glibc serves a block that large by mmap and returns it
by munmap when the call ends, so each call maps fresh pages and the kernel faults every one in:
219k faults of 4 KiB pages and 0.3-0.5 s of a 1.8-2.4 s W3 step on this machine. Whatever the
mode, a smaller program faults less: in micro-batches (algo.micro_batch_tokens, 1,536 tokens for
W3) the block is one micro-batch's, a quarter of the faults and the step 1.15x faster. The modes:

- system (the default): malloc as glibc sets it up.
- huge: glibc's tunable glibc.malloc.hugetlb=1 (glibc >= 2.35) advises the kernel to back such
  blocks with transparent huge pages (where the kernel offers them: "always" or "madvise" in
  /sys/kernel/mm/transparent_hugepage/enabled), so a call faults 2 MiB pages in, 512x fewer
  faults, and memory is returned as before. It pays where freed memory is reused while it is
  still the guest's: benchmarks/host_memory.py (W3's train step back to back, no shared prompts)
  ~219k -> ~1k faults a step, the step 1.2x faster on one device and on 2 x 2. It costs where a
  VM hands memory that has been free a while back to its host (free page reporting: a
  virtio_balloon, as on this project's Firecracker machines): a 2 MiB page taken from such memory
  faults in at 0.2 GB/s against 2.2 GB/s for 4 KiB pages (10 GB/s for a freed page reused at
  once), and a whole RL step, whose trainer idles while the engine generates, ran 1.1-1.7x
  slower (W4 on this machine, benchmarks/README.md's host-memory section), hence not the
  default. glibc reads tunables only when a process starts, so restart_with_huge_pages() re-runs
  a program's command line with it (the CLI's first step); child processes and Ray workers
  inherit it. In a notebook it applies only if the kernel was started with
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1. A GLIBC_TUNABLES that already sets glibc.malloc.hugetlb
  is left as it is. Where the glibc or the kernel cannot serve it, the program says so in one
  line on stderr and runs on.
- keep: keep_freed_memory() makes malloc serve such blocks from its heap (one arena, no mmap) and
  never shrink it, so a block one call frees is the next call's, faults already paid: one device
  1.86 -> 1.45 s a step, but the heap fragments (1.6 -> 3.4 GB after 16 steps; on a 2 x 2 mesh,
  where four devices' programs allocate at once, 3.0 -> 7.8 GB, with 3.3-4.5 s steps whenever it
  grows). It suits long single-device CPU runs with memory to spare. Call it before JAX starts its
  CPU backend (meshes.prepare_cpu_devices does), as threads choose their malloc arena when they
  first allocate.
"""
import ctypes
import os
import sys

from jaxrl_hex.errors import UserError

MODES = ("system", "huge", "keep")
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
# glibc's mallopt(3) parameters
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def malloc_mode() -> str:
  mode = os.environ.get("JAXRL_HEX_MALLOC") or "system"
  if mode not in MODES:
    raise UserError(
        f"JAXRL_HEX_MALLOC={mode!r} is not a mode; use one of {', '.join(MODES)} (jaxrl_hex/host_memory.py)")
  return mode


def _glibc_version() -> tuple:
  """(major, minor) of the glibc this process runs on, () elsewhere (the C library's own answer:
  platform.libc_ver() reads through the Python binary instead)."""
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
  except (AttributeError, ValueError, OSError):  # no confstr, or no such name: not glibc
    return ()
  return tuple(int(p) for p in version.split(".")[:2]) if name == "glibc" else ()


def kernel_offers_huge_pages() -> bool:
  """Whether the kernel backs advised memory with transparent huge pages ("[always]" or "[madvise]")."""
  try:
    with open(THP_SETTING) as f:
      return "[never]" not in f.read()
  except OSError:
    return False


def with_huge_pages(env: dict) -> dict:
  """env plus glibc's huge-page tunable, after any tunables it already sets (unless one is it)."""
  tunables = env.get("GLIBC_TUNABLES", "")
  if any(t.split("=")[0] == HUGE_PAGES_TUNABLE.split("=")[0] for t in tunables.split(":")):
    return dict(env)
  return dict(env, GLIBC_TUNABLES=f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE)


def _huge_pages_asked() -> bool:
  """Mode huge, and this process started without the tunable."""
  return malloc_mode() == "huge" and with_huge_pages(os.environ) != dict(os.environ)


def _unservable() -> str | None:
  """Why this machine's glibc or kernel cannot serve huge pages (None: they can)."""
  glibc = _glibc_version()
  if glibc < (2, 35):
    return (f"glibc {'.'.join(map(str, glibc))} has no glibc.malloc.hugetlb tunable (2.35 has)"
            if glibc else "the C library is not glibc")
  if not kernel_offers_huge_pages():
    return f"the kernel offers no transparent huge pages ({THP_SETTING} says [never] or is missing)"
  return None


def huge_pages_missing() -> str | None:
  """Under mode huge in a process started without the tunable, why this machine cannot serve it
  (None: it can, or nothing is asked)."""
  return _unservable() if _huge_pages_asked() else None


def huge_pages_pending() -> bool:
  """Mode huge, a glibc and kernel that can serve it, and this process started without it."""
  return _huge_pages_asked() and _unservable() is None


def restart_with_huge_pages():
  """Re-run this process's command line with the tunable where huge_pages_pending(): call it first
  thing in a program's entry point (it replaces the process; nothing before it is kept). Where
  mode huge cannot be served, one line on stderr says why and the program runs on as it is."""
  missing = huge_pages_missing()
  if missing:
    print(f"jaxrl-hex: JAXRL_HEX_MALLOC=huge: {missing}; running with malloc as glibc sets it up", file=sys.stderr)
  elif huge_pages_pending():
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_huge_pages(os.environ))


def keep_freed_memory() -> bool:
  """Under JAXRL_HEX_MALLOC=keep (glibc only), tune malloc as the module says; -> whether it did."""
  if malloc_mode() != "keep" or not _glibc_version():
    return False
  libc = ctypes.CDLL("libc.so.6")
  # one arena: a thread's own arena would still mmap a block larger than its 64 MB heaps;
  # no mmap: large blocks come from the heap; trim threshold -1 (SIZE_MAX): never shrink it.
  return all(
      libc.mallopt(param, value) == 1 for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
