"""Host memory for XLA:CPU (JAXRL_HEX_MALLOC=system|huge|keep): how a program's temporaries get pages.

XLA:CPU takes every buffer of a program from glibc's malloc, and a program's temporaries from one
block per call (a W3 train step's: 897 MB). glibc serves a block that large by mmap and returns it
by munmap when the call ends, so each call maps fresh pages and the kernel faults every one in:
219k faults of 4 KiB pages and 0.3-0.5 s of a 1.8-2.4 s W3 step on this machine. Whatever the
mode, a smaller program faults less: in micro-batches (algo.micro_batch_tokens, 1,536 tokens for
W3) the block is one micro-batch's, a quarter of the faults and the step 1.15x faster.

Whatever the mode, on x86 glibc a program starts with glibc.cpu.x86_non_temporal_threshold=0x40000:
memcpy of 256 KiB or more stores past the cache (non-temporal stores), as glibc does by itself
only above three quarters of the L3 cache's share per thread (114 MiB on this project's 300 MB-L3
VMs; a few MiB on common servers). Weight sync copies a model in region pieces of 0.1-2 MiB,
written once and read only by the next version's decode steps: with the cache's stores each
piece's destination is read in first, and 128 MB copied in 1 MiB pieces ran at 5.8 GB/s against
10.9 for one 128 MB memcpy, with it at 10.0 (by hand, one thread). benchmarks/README.md's
weight-sync section has what it changed there (stacked params, back to back without and with it:
device_put 1.31x -> 1.08x one memcpy, the object store 3.44x -> 2.78x); decode (W1, W2; W5 within
this VM's swing) and the main job ran as fast with it.
A GLIBC_TUNABLES that already sets it is left as it is.

The modes:

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
  default. glibc reads tunables only when a process starts, so restart_with_tunables() re-runs a
  program's command line with it (the CLI's first step); child processes and Ray workers inherit
  it. In a notebook it applies only if the kernel was started with
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
import platform
import sys

from jaxrl_hex.errors import UserError

MODES = ("system", "huge", "keep")
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
STREAMING_COPIES_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x40000"  # every mode, x86 glibc
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


def with_tunables(env: dict, tunables) -> dict:
  """env plus each of `tunables` whose name its GLIBC_TUNABLES does not set yet, after those it
  sets (the user's own setting of one stands)."""
  have = env.get("GLIBC_TUNABLES", "")
  named = {t.split("=")[0] for t in have.split(":")}
  added = [t for t in tunables if t.split("=")[0] not in named]
  return dict(env, GLIBC_TUNABLES=":".join([have] * bool(have) + added)) if added else dict(env)


def _huge_pages_asked() -> bool:
  """Mode huge, and this process started without the tunable."""
  return malloc_mode() == "huge" and with_tunables(os.environ, [HUGE_PAGES_TUNABLE]) != dict(os.environ)


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


def tunables() -> list:
  """The glibc tunables a program runs with: streaming copies on x86 glibc, and huge pages under
  mode huge where this machine can serve them."""
  streaming = bool(_glibc_version()) and platform.machine() in ("x86_64", "AMD64")
  huge = malloc_mode() == "huge" and _unservable() is None
  return [STREAMING_COPIES_TUNABLE] * streaming + [HUGE_PAGES_TUNABLE] * huge


def restart_with_tunables():
  """Re-run this process's command line with tunables() where it started without one of them:
  call it first thing in a program's entry point (it replaces the process; nothing before it is
  kept). Where mode huge cannot be served, one line on stderr says why and the program runs on."""
  missing = huge_pages_missing()
  if missing:
    print(f"jaxrl-hex: JAXRL_HEX_MALLOC=huge: {missing}; running with malloc as glibc sets it up", file=sys.stderr)
  env = with_tunables(os.environ, tunables())
  if env != dict(os.environ):
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def keep_freed_memory() -> bool:
  """Under JAXRL_HEX_MALLOC=keep (glibc only), tune malloc as the module says; -> whether it did."""
  if malloc_mode() != "keep" or not _glibc_version():
    return False
  libc = ctypes.CDLL("libc.so.6")
  # one arena: a thread's own arena would still mmap a block larger than its 64 MB heaps;
  # no mmap: large blocks come from the heap; trim threshold -1 (SIZE_MAX): never shrink it.
  return all(
      libc.mallopt(param, value) == 1 for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
