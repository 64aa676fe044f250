"""Joining an `mx.distributed` group for tensor parallelism, and running N ranks on this host.

A rank is launched either by MLX's launcher (`mlx.launch`, which sets MLX_RANK and MLX_HOSTFILE for the ring
backend, or the NCCL / MPI variables) or by `run_local_ranks`, which starts N copies of the current command on
127.0.0.1 over the ring backend (what `mlxcel generate --tp-size N` does when it was not launched).

Failure handling: joining is bounded (`MLXCEL_TP_JOIN_TIMEOUT`, default 60 s: a rank that never joins makes
the others exit 1 with a message instead of hanging); a peer that exits mid-run makes the ring backend raise
on the next collective, which `lost_peer_errors` turns into one line (or, where MLX never returns, ring_watch.py
exits the rank); `run_local_ranks` stops the remaining ranks when one fails.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Sequence

from .. import settings
from ..errors import InputError, RuntimeFailure

JOIN_TIMEOUT_ENV = "MLXCEL_TP_JOIN_TIMEOUT"
_LAUNCH_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def is_launched() -> bool:
    """True inside a rank started by mlx.launch, mpirun or run_local_ranks."""
    return any(v in os.environ for v in _LAUNCH_VARS)


_WATCHDOG = """
import os, signal, sys, time
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(timeout)
try:
    os.kill(pid, 0)
except OSError:
    sys.exit(0)
sys.stderr.write(message)
sys.stderr.flush()
os.kill(pid, signal.SIGKILL)
"""


def _backend() -> str:
    explicit = settings.get("MLXCEL_TP_BACKEND")
    if explicit:
        return explicit
    if "MLX_IBV_DEVICES" in os.environ:
        return "jaccl"
    if "MLX_HOSTFILE" in os.environ:
        return "ring"
    if "NCCL_HOST_IP" in os.environ:
        return "nccl"
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return "mpi"
    return "any"


def init_group(tp_size: int, *, quiet_others: bool = True):
    """Join the global group of `tp_size` ranks (None for tp_size 1). Ranks > 0 then print nothing but errors
    (unless `quiet_others` is False). Exits the process (status 1) if the others do not join in time."""
    if tp_size < 1:
        raise InputError(f"--tp-size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return None
    import mlx.core as mx

    if not is_launched():
        raise InputError(
            f"--tp-size {tp_size}: this process was not started as a rank "
            "(run it under `mlx.launch`, or let mlxcel start the ranks on this host)"
        )
    timeout = settings.get(JOIN_TIMEOUT_ENV)
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    message = (
        f"mlxcel: error: rank {rank}: the other ranks did not join within {timeout:g} s "
        f"({JOIN_TIMEOUT_ENV}); check the hosts, the ports and that every rank was started\n"
    )
    # mx.distributed.init keeps the GIL while it connects, so no Python thread or signal handler can stop it:
    # a separate watchdog process reports and kills this one if joining takes longer than `timeout`.
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout), message],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        group = mx.distributed.init(strict=True, backend=_backend())
    except RuntimeError as exc:
        raise RuntimeFailure(f"cannot join the tensor-parallel group: {_first_line(exc)}") from exc
    finally:
        watchdog.kill()
        watchdog.wait()
    if group.size() != tp_size:
        raise InputError(f"--tp-size {tp_size} but {group.size()} ranks were launched")
    # A peer's death can leave this rank stuck inside MLX (ring_watch.py). Not on a terminal: the watch puts a pipe
    # on fd 2, which would change what the chat's line editing and colours see there (and someone can press Ctrl-C).
    if _backend() == "ring" and not os.isatty(2):
        from .ring_watch import RingFailureWatch

        RingFailureWatch(group.rank())
    if group.rank() > 0 and quiet_others:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorsOnly(sys.stderr, group.rank())
    return group


_SAID_BY_RANK_0: set[str] = set()


def said_by_rank_0(message: str) -> str:
    """Mark an error message that every rank raises alike (a check of the model all ranks build): a rank > 0 leaves
    it to rank 0, so the terminal shows it once instead of once per rank."""
    _SAID_BY_RANK_0.add(message)
    return message


class _ErrorsOnly(io.TextIOBase):
    """stderr of a rank > 0: only `mlxcel: error:` lines pass, tagged with the rank (but those rank 0 prints too)."""

    def __init__(self, target, rank: int):
        self.target, self.rank, self.buffer_text = target, rank, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buffer_text += text
        *lines, self.buffer_text = self.buffer_text.split("\n")
        for line in lines:
            message = line[len("mlxcel: error: ") :]
            if line.startswith("mlxcel: error: ") and message not in _SAID_BY_RANK_0:
                self.target.write(f"mlxcel: error: rank {self.rank}: {message}\n")
                self.target.flush()
        return len(text)


def shared_seed(group, seed: int | None) -> int | None:
    """Rank 0's seed on every rank (rank 0 draws one when none was given), so sampling agrees everywhere."""
    if group is None or seed is not None:
        return seed
    import mlx.core as mx

    mine = int.from_bytes(os.urandom(3), "little") if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group).item())


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@contextmanager
def lost_peer_errors(group):
    """A backend error from a collective (a rank exited or crashed) -> RuntimeFailure naming this rank."""
    try:
        yield
    except (RuntimeError, RuntimeFailure) as exc:  # raised by the collective, or reported by the engine's row
        message = _first_line(exc)
        marker = next((m for m in _BACKEND_MARKERS if m in message), None)
        if group is None or marker is None:
            raise
        raise RuntimeFailure(
            f"rank {group.rank()}: lost the connection to another rank "
            f"({message[message.index(marker) :]}); did it exit or crash?"
        ) from exc


_BACKEND_MARKERS = ("[ring]", "[nccl]", "[mpi]", "[jaccl]")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_backend() -> str:
    """The backend for ranks started on this host: MLXCEL_TP_BACKEND, else NCCL when MLX runs on CUDA (one GPU
    per rank), else the ring over 127.0.0.1."""
    explicit = settings.get("MLXCEL_TP_BACKEND")
    if explicit:
        if explicit not in ("ring", "nccl"):
            raise InputError(f"MLXCEL_TP_BACKEND must be ring or nccl for ranks started on this host, got '{explicit}'")
        return explicit
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"


def _rank_environments(tp_size: int, backend: str, hostfile: str | None) -> list[dict[str, str]]:
    if backend == "ring":
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": hostfile, "MLXCEL_TP_BACKEND": "ring"} for r in range(tp_size)]
    # NCCL: rank 0 hosts the rendezvous; each rank sees one GPU (the rank-th of those visible to us).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        gpus, where = visible.split(","), "CUDA_VISIBLE_DEVICES lists"
    else:
        import mlx.core as mx

        gpus, where = [str(r) for r in range(mx.device_count(mx.gpu))], "this machine has"
    if len(gpus) < tp_size:
        raise InputError(f"--tp-size {tp_size} with NCCL needs {tp_size} GPUs, but {where} {len(gpus)}")
    port = _free_ports(1)[0]
    return [
        {
            "MLX_RANK": str(r),
            "MLX_WORLD_SIZE": str(tp_size),
            "NCCL_HOST_IP": "127.0.0.1",
            "NCCL_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": gpus[r],
            "MLXCEL_TP_BACKEND": "nccl",
        }
        for r in range(tp_size)
    ]


def run_local_ranks(
    tp_size: int,
    argv: Sequence[str] | None = None,
    stdin_data: bytes | None = None,
    grace_s: float = 10.0,
    leader_stdin: bool = False,
    command: Sequence[str] | None = None,
) -> int:
    """Run `argv` (default: this command) as `tp_size` ranks on this host (NCCL on CUDA, else the ring backend
    over 127.0.0.1; see local_backend).

    `command`: run this whole command line instead of `mlxcel ARGV` (a script that joins the group itself).
    Rank 0 keeps this terminal's stdout/stderr; the others print only errors. Every rank gets `stdin_data`
    (or no stdin); with `leader_stdin`, rank 0 reads this process's stdin (interactive chat) and the others
    none. Returns rank 0's exit status, or the first failing rank's: when a rank fails, the others get
    `grace_s` to fail on their own (they notice the lost peer) and are then terminated. SIGTERM is passed on
    to rank 0 (a server shuts down and tells the others); SIGINT from a terminal reaches every rank itself.
    """
    if command is None:
        argv = list(sys.argv[1:] if argv is None else argv)
        command = [sys.executable, "-c", "import sys; from mlxcel_cli.main import main; sys.exit(main())", *argv]
    backend = local_backend()
    hostfile = None
    if backend == "ring":
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="mlxcel-ring-", delete=False) as f:
            json.dump([[f"127.0.0.1:{p}"] for p in _free_ports(tp_size)], f)
        hostfile = f.name
    try:
        envs = _rank_environments(tp_size, backend, hostfile)
        return _supervise(command, envs, stdin_data, grace_s, leader_stdin)
    finally:
        if hostfile is not None:
            os.unlink(hostfile)


def _supervise(
    command, envs: list[dict[str, str]], stdin_data: bytes | None, grace_s: float, leader_stdin: bool
) -> int:
    procs = []
    for rank, extra in enumerate(envs):
        if leader_stdin:
            stdin = None if rank == 0 else subprocess.DEVNULL
        else:
            stdin = subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL
        procs.append(
            subprocess.Popen(
                command, env={**os.environ, **extra}, stdin=stdin, stdout=None if rank == 0 else subprocess.DEVNULL
            )
        )
        if stdin == subprocess.PIPE:
            try:
                procs[-1].stdin.write(stdin_data)
                procs[-1].stdin.close()
            except BrokenPipeError:
                pass
    # Set after the ranks started (they must not inherit SIG_IGN). Ctrl-C in a terminal reaches every rank
    # of the foreground process group directly, and each decides (a chat interrupts its reply); a SIGINT
    # sent to this process alone (a script, a test) is passed on to rank 0.
    forward = lambda signum, frame: procs[0].send_signal(signum)  # noqa: E731
    previous = (
        signal.signal(signal.SIGTERM, forward),
        signal.signal(signal.SIGINT, signal.SIG_IGN if _terminal_foreground() else forward),
    )
    try:
        return _wait_ranks(procs, grace_s)
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def _terminal_foreground() -> bool:
    """True when this process runs in the foreground of a terminal (so Ctrl-C signals its whole group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _wait_ranks(procs: list[subprocess.Popen], grace_s: float) -> int:
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.wait()
        return 130
    codes = [p.returncode for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if not bad:
        return 0
    rank, code = bad[0]
    if rank != 0 and codes[0] == 0:
        print(f"mlxcel: error: rank {rank} exited with status {code}", file=sys.stderr)
    return code if code > 0 else 1
