"""Multi-process runs: start, agreement between processes, process-0-only writes, peer failure.

Every process calls `maybe_initialize_distributed()` first thing. It reads

- `HSD_DISTRIBUTED=auto`: JAX's own cluster detection (TPU pods, SLURM, Open MPI);
- or `HSD_COORDINATOR=host:port` (process 0's address), `HSD_NUM_PROCESSES=N`, `HSD_PROCESS_ID=i`
  and optionally `HSD_LOCAL_DEVICE_IDS=0,1,...` (multi-GPU hosts, CPU test runs);
- `HSD_INIT_TIMEOUT_S` (default 300) and `HSD_HEARTBEAT_TIMEOUT_S` (default 100).

With an explicit coordinator, the processes first meet on process 0's port in a short handshake of
their own, so that an unreachable coordinator, a wrong process count or a duplicate process id is a
clear `DistributedError` at start instead of an abort from inside JAX's runtime. Once running, a
process that dies makes the others fail: a collective with it raises at once, and JAX's heartbeat
ends every process within the heartbeat timeout; `exit_on_peer_failure` turns that into one line.

Rules for multi-process code: every process runs the same jitted programs in the same order, so any
decision made from local measurements (elapsed time, timings) goes through `agree` (process 0's
value wins); only process 0 writes files (`is_primary`) and the others wait at a `barrier` before
reading them.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

import jax
import numpy as np

from hsd_jax.config import ConfigError


class DistributedError(ConfigError):
    """A multi-process run that cannot start: bad environment, unreachable coordinator, wrong count."""


_STARTED = False


def _env_int(name: str, default: int | None = None, minimum: int = 0) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DistributedError(f"{name} must be a whole number, got {raw!r}") from None
    if value < minimum:
        raise DistributedError(f"{name} must be >= {minimum}, got {value}")
    return value


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"HSD_COORDINATOR must be host:port (e.g. 10.0.0.2:8476), got {address!r}")
    return host.strip("[]"), int(port)


def _read_line(conn: socket.socket, deadline: float) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode("utf-8", "replace").strip()


def _handshake_coordinator(port: int, num_processes: int, timeout: float) -> None:
    """Process 0: wait for the other N-1 processes on the coordinator's port; check ids and counts."""
    try:
        server = socket.create_server(("", port))
    except OSError as e:
        raise DistributedError(f"process 0 cannot listen on coordinator port {port}: {e}") from None
    deadline = time.monotonic() + timeout
    peers: dict[int, socket.socket] = {}
    problem = None
    with server:
        try:
            while len(peers) < num_processes - 1 and problem is None:
                server.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    conn, addr = server.accept()
                except socket.timeout:
                    problem = (f"only {len(peers)} of the {num_processes - 1} other processes reached the "
                               f"coordinator within {timeout:.0f} s (HSD_NUM_PROCESSES={num_processes}): start all "
                               f"{num_processes} processes, or set HSD_NUM_PROCESSES to the number started")
                    break
                try:
                    hello = json.loads(_read_line(conn, deadline))
                    pid, n = int(hello["id"]), int(hello["n"])
                except (OSError, ValueError, KeyError, TypeError):
                    conn.close()   # not one of ours (a port scan, a stray client): keep waiting
                    continue
                if n != num_processes:
                    problem = (f"process {pid} was started with HSD_NUM_PROCESSES={n}, process 0 with "
                               f"{num_processes}: every process needs the same count")
                elif pid in peers or pid == 0:
                    problem = f"two processes were started with HSD_PROCESS_ID={pid}: each id must be used once"
                if problem is None:
                    peers[pid] = conn
                else:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"error {problem}\n".encode())
                    conn.close()
            reply = "ok\n" if problem is None else f"error {problem}\n"
            for conn in peers.values():
                with contextlib.suppress(OSError):
                    conn.sendall(reply.encode())
            for conn in peers.values():  # the peers close first, so no lingering socket holds the port
                with contextlib.suppress(OSError):
                    _read_line(conn, time.monotonic() + 5)
        finally:
            for conn in peers.values():
                conn.close()
    if problem is not None:
        raise DistributedError(problem)


def _handshake_peer(host: str, port: int, process_id: int, num_processes: int, timeout: float) -> None:
    """Process i > 0: reach process 0 (retrying until the timeout), say who we are, wait for its verdict."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(min(5.0, deadline - time.monotonic()), 0.01))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator at {host}:{port} within {timeout:.0f} s: "
                    f"is process 0 running, and is HSD_COORDINATOR its reachable address?") from None
            time.sleep(0.2)
    with conn:
        try:
            conn.sendall((json.dumps({"id": process_id, "n": num_processes}) + "\n").encode())
            reply = _read_line(conn, time.monotonic() + timeout + 10)   # process 0 may wait its full timeout
        except OSError:
            reply = ""
    if reply.startswith("error "):
        raise DistributedError(reply[len("error "):])
    if reply != "ok":
        raise DistributedError(f"process {process_id}: no answer from the coordinator at {host}:{port} "
                               f"(process 0 still waiting for the others, or not an hsd coordinator)")


def maybe_initialize_distributed() -> bool:
    """Start JAX's multi-process runtime when the environment asks for it (see the module doc);
    True if started. Must run before any other JAX call; later calls are no-ops."""
    global _STARTED
    if _STARTED:
        return True
    env = os.environ
    init_timeout = _env_int("HSD_INIT_TIMEOUT_S", 300, minimum=1)
    heartbeat = _env_int("HSD_HEARTBEAT_TIMEOUT_S", 100, minimum=1)
    timeouts = dict(initialization_timeout=init_timeout, heartbeat_timeout_seconds=heartbeat)
    if env.get("HSD_DISTRIBUTED", "").lower() == "auto":
        jax.distributed.initialize(**timeouts)
    elif env.get("HSD_COORDINATOR"):
        missing = [k for k in ("HSD_NUM_PROCESSES", "HSD_PROCESS_ID") if not env.get(k)]
        if missing:
            raise DistributedError(f"HSD_COORDINATOR is set but {', '.join(missing)} is not")
        host, port = _split_address(env["HSD_COORDINATOR"])
        n = _env_int("HSD_NUM_PROCESSES", minimum=1)
        pid = _env_int("HSD_PROCESS_ID")
        if pid >= n:
            raise DistributedError(f"HSD_PROCESS_ID={pid} is out of range for HSD_NUM_PROCESSES={n} (0..{n - 1})")
        local = env.get("HSD_LOCAL_DEVICE_IDS")
        try:
            local_ids = [int(i) for i in local.split(",")] if local else None
        except ValueError:
            raise DistributedError(f"HSD_LOCAL_DEVICE_IDS must be comma-separated ids, got {local!r}") from None
        if n > 1:
            if pid == 0:
                _handshake_coordinator(port, n, init_timeout)
            else:
                _handshake_peer(host, port, pid, n, init_timeout)
        jax.distributed.initialize(coordinator_address=f"{host}:{port}" if ":" not in host else f"[{host}]:{port}",
                                   num_processes=n, process_id=pid, local_device_ids=local_ids, **timeouts)
    else:
        return False
    _STARTED = True
    return True


def is_primary() -> bool:
    """True in process 0: the one that prints and writes files."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


def agree(value):
    """Process 0's `value` (any JSON-serialisable object) in every process; `value` itself in a
    single-process run. For decisions taken from local measurements (time limits, timings)."""
    if not multi_process():
        return value
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_primary() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = np.zeros(size, np.uint8)
    buf[: data.size] = data
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode())


def broadcast_arrays(tree):
    """Process 0's host arrays (a pytree of numpy arrays of the same shapes everywhere) in every process."""
    if not multi_process():
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (e.g. before reading what process 0 wrote)."""
    if multi_process():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def exit_on_peer_failure():
    """In a multi-process run, an exception ends this process at once with one clear line (exit 1)
    instead of a traceback followed by a wait for JAX's shutdown barrier; a no-op otherwise."""
    try:
        yield
    except Exception as e:
        if not _STARTED or not multi_process():
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: process {jax.process_index()} of {jax.process_count()} stopped: {type(e).__name__}: "
              f"{first[:500]}\n(in a multi-process run this usually means another process failed or was "
              f"killed; see its log)", file=sys.stderr, flush=True)
        os._exit(1)


def primary_options():
    """Orbax options for saves and restores that process 0 makes alone (host arrays, no collective)."""
    import orbax.checkpoint as ocp

    return ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})


def primary_checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer(multiprocessing_options=primary_options())
