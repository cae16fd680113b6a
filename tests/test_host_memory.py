"""Freed host buffers reused on the CPU (`hsd_jax.host_memory`): no fresh page faults per call."""
import os
import subprocess
import sys

import pytest

from hsd_jax import host_memory, load_target
from tests.helpers import save_hf_dir, tiny_target

PROBE = """
import resource, numpy as np
from hsd_jax import host_memory
on = host_memory.enable()
a = np.ones(10_000_000, np.float32); del a          # 40 MB: above glibc's default mmap threshold
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(10_000_000, np.float32)
print(on, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _probe(flag: str) -> tuple[str, int]:
    env = dict(os.environ, HSD_RETAIN_HOST_MEMORY=flag)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    on, faults = out.stdout.split()
    return on, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_40_mb_block_is_reused_without_page_faults_unless_opted_out():
    (on, kept), (off, fresh) = _probe("1"), _probe("0")
    if on == "False":
        pytest.skip("not glibc")
    assert (on, off) == ("True", "False")
    assert fresh > 10 * (kept + 1), (kept, fresh)


THREAD_PROBE = """
import ctypes, resource, sys, threading
from hsd_jax import host_memory
if sys.argv[1] == "late":
    host_memory.MAX_THREADS_FOR_ONE_ARENA = 0
on = host_memory.enable()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []
def work():   # as XLA's threads allocate a KV cache's k and v: two 47 MB blocks, written, freed
    for _ in range(3):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(47 << 20) for _ in range(2)]
        for b in blocks:
            ctypes.memset(b, 1, 47 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
t = threading.Thread(target=work)
t.start()
t.join()
print(on, sum(faults[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_blocks_freed_on_another_thread_are_reused_with_one_arena():
    """Enabled before the process starts its threads, every thread allocates from one arena: a worker's
    two 47 MB blocks come back without faults the next time (a thread's own arena, heaps of 64 MiB,
    unmapped one of them each round); set late (threads running), that arena is left as it was."""
    runs = {}
    for when in ("early", "late"):
        out = subprocess.run([sys.executable, "-c", THREAD_PROBE, when], capture_output=True, text=True, check=True)
        on, faults = out.stdout.split()
        if on == "False":
            pytest.skip("not glibc")
        runs[when] = int(faults)
    assert runs["late"] > 10 * (runs["early"] + 100), runs


def test_load_target_enables_it_for_a_cpu_run(tmp_path):
    save_hf_dir(tiny_target(vocab=32, hidden=32), tmp_path)
    host_memory.enable.cache_clear()
    load_target(str(tmp_path), tokenizer=False)
    assert host_memory.enable.cache_info().currsize == 1
