"""Freed host buffers kept for reuse on the CPU, so each call does not fault in fresh pages.

XLA:CPU allocates its programs' buffers with malloc; glibc serves any block above its mmap
threshold (at most 32 MiB by default) with a fresh mmap and unmaps it on free, so every generate
call faults in its KV cache, the widened prefill cache and the decode loop's temporaries page by
page again (a 47 MB cache widening 15 ms fresh, 3.4 ms reused; SmolLM2 on a 2-core Zen 4:
`generate` 0.96x the time for `ar`, 0.93x for hsd). `enable()` (called by `load_target` when JAX
runs on the CPU) raises glibc's mmap and trim thresholds to THRESHOLD_BYTES, so such blocks come from the
heap and stay there when freed: the process keeps up to that much freed memory for its next call.
XLA allocates on its own threads, and glibc gives each thread an arena of heaps of at most 64 MiB: a
heap emptied by a free is unmapped, so the KV cache's k and v (47 MB each at capacity 2048) still
faulted in afresh every call (34,760 faults, ~35 ms of an 90 ms 2-token `generate`, Zen 5 VM).
So `enable()` first asks for one arena for every thread (M_ARENA_MAX 1; 0 faults, 57 ms), where the
process has not started its thread pools yet (`load_target` calls it before anything starts JAX's
backend): threads keep the arenas they have, and set later it did not help (measured: more faults).
`HSD_RETAIN_HOST_MEMORY=0` leaves malloc as it was; other C libraries than glibc are left alone.
"""
from __future__ import annotations

import ctypes
import functools
import os

ENV = "HSD_RETAIN_HOST_MEMORY"
THRESHOLD_BYTES = 1 << 30
MAX_THREADS_FOR_ONE_ARENA = 4    # `import jax` starts one; its CPU backend ~45 (2-core VM)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8     # glibc's mallopt parameters (malloc.h)


def disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def threads() -> int:
    """The process's native threads (Linux: /proc/self/task), 0 where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


@functools.cache
def enable() -> bool:
    """Raise glibc's thresholds once per process, and ask for one arena while the process has at most
    MAX_THREADS_FOR_ONE_ARENA threads; whether the thresholds were set (False: opted out, or no glibc)."""
    if disabled():
        return False
    try:
        libc = ctypes.CDLL(None)       # the C library this process already runs on (no lookup, no subprocess)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version      # glibc only: its mallopt takes these parameter numbers
    except (OSError, AttributeError):
        return False
    if 0 < threads() <= MAX_THREADS_FOR_ONE_ARENA:
        mallopt(_M_ARENA_MAX, 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
