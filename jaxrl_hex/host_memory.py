"""Host memory for XLA:CPU, opt-in (JAXRL_HEX_MALLOC=keep): freed buffers stay with the process.

XLA:CPU takes every buffer of a program from glibc's malloc, and a program's temporaries from one
block per call (a W3 train step's: 897 MB). glibc serves a block that large by mmap and returns it
by munmap when the call ends, so each call maps fresh pages and faults every one of them in (the
kernel zeroes each 4 KiB page): 220k page faults and 0.3-0.5 s of a 1.8 s W3 step in the kernel on
this machine. keep_freed_memory() makes malloc serve such blocks from its heap (one arena, no
mmap) and never shrink it, so a block one call frees is the next call's, faults already paid.

Why it is not the default (benchmarks/host_memory.py, W3 without shared prompts, 16 steps on one
core; median step, minor faults a step, resident memory first -> last step):
- one device: 1.86 s, 219k faults, 1.7 GB with malloc as it is; 1.45 s, 0 faults, but
  1.6 -> 3.4 GB kept: the heap fragments, and the steps that grow it fault fresh pages in, which
  costs far more on this VM than recycled mmap pages;
- the 2 x 2 mesh (four devices' programs allocate at once): 2.11 s, 1.8 GB as it is; kept,
  1.93 s but 3.0 -> 7.8 GB, with steps of 3.3-4.5 s whenever the heap grows.
So it suits long single-device CPU runs with memory to spare. Call it before JAX starts its CPU
backend (meshes.prepare_cpu_devices does), as threads choose their malloc arena when they first
allocate.
"""
import ctypes
import os
import platform

# glibc's mallopt(3) parameters
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
  """Under JAXRL_HEX_MALLOC=keep (glibc only), tune malloc as the module says; -> whether it did."""
  if os.environ.get("JAXRL_HEX_MALLOC", "system") != "keep" or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL("libc.so.6")
  # one arena: a thread's own arena would still mmap a block larger than its 64 MB heaps;
  # no mmap: large blocks come from the heap; trim threshold -1 (SIZE_MAX): never shrink it.
  return all(
      libc.mallopt(param, value) == 1 for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
