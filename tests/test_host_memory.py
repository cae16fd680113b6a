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


def test_load_target_enables_it_for_a_cpu_run(tmp_path):
    save_hf_dir(tiny_target(vocab=32, hidden=32), tmp_path)
    host_memory.enable.cache_clear()
    load_target(str(tmp_path), tokenizer=False)
    assert host_memory.enable.cache_info().currsize == 1
