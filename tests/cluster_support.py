"""Processes for the cluster tests: a Beam job service, EXTERNAL SDK worker pools that cannot see the
driver's directories, a moto S3 server, a Dask scheduler and workers, a black-hole socket.

Every process is started here with ``subprocess.Popen`` and stopped by its own PID (``Service.stop``):
SIGTERM, then SIGKILL after a grace period; a worker pool under ``unshare`` is its own process group
(``start_new_session``), and only that group (whose id is the PID we started) is signalled, because
the pool forks one SDK worker per job.

Isolation of a worker pool (the situation on Flink, Spark or Dataflow, where workers run on other
machines): the pool runs under ``unshare -m`` (a private mount namespace, root only) with a fresh tmpfs
mounted over each directory the driver works in (its working, temporary, input and output directories),
so a worker that opens a driver-local path finds an empty directory, and a file it writes there lands
in its own tmpfs, which the driver never sees. What stays visible is what a worker image or a mounted
secret would hold: the source tree, the venv and the noise key's directory (the tests keep these
outside the hidden directories). The pool's PATH starts with the
venv's ``bin`` so the SDK worker it spawns is this Python with Beam.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PYTHON = sys.executable
VENV_BIN = str(Path(sys.executable).parent)
REPO = Path(__file__).resolve().parent.parent
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dead_port() -> int:
    """A port nothing listens on (bound, then released)."""
    return free_port()


class BlackHole:
    """A listening TCP socket that accepts (the kernel completes the handshake) and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Service:
    """One process we started: its PID, port and log file."""

    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    group: bool = False  # True: the PID leads its own process group (start_new_session); signal the group
    _log: object = field(default=None, repr=False)

    def log_text(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        pid = self.proc.pid
        if self.proc.poll() is None:
            self._signal(pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(pid, signal.SIGKILL)
                self.proc.wait(timeout=grace)
        elif self.group:
            self._signal(pid, signal.SIGKILL)  # the leader is gone; children it forked may be left in its group
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]

    def _signal(self, pid: int, sig: int) -> None:
        try:
            if self.group:
                os.killpg(pid, sig)  # the group whose id is the PID we started, nothing else
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_port(svc: Service, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while True:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode}: {svc.log_text()}")
        try:
            socket.create_connection(("127.0.0.1", svc.port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                svc.stop()
                raise RuntimeError(f"{svc.name} did not listen on {svc.port} within {timeout:.0f} s: {svc.log_text()}")
            time.sleep(0.3)


def start(name: str, argv: Sequence[str], port: int, log_dir: Path, *, env: dict[str, str] | None = None,
          group: bool = False, wait: bool = True, timeout: float = 60.0) -> Service:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - held open for the process's life, closed by Service.stop
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=group, stdin=subprocess.DEVNULL)
    svc = Service(name, proc, port, log_path, group=group, _log=log)
    if wait:
        wait_port(svc, timeout)
    return svc


def pythonpath_env() -> dict[str, str]:
    """PYTHONPATH with the tree under test (and its tests, whose functions tests pickle) first."""
    parts = [str(REPO), str(REPO / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(parts))}


def start_job_service(log_dir: Path, env: dict[str, str] | None = None) -> Service:
    """Beam's local job service (through tests/beam_job_service.py, which honours --sdk_worker_parallelism)."""
    port = free_port()
    return start("job_service", [PYTHON, str(REPO / "tests" / "beam_job_service.py"), "--port", str(port)],
                 port, log_dir, env={**pythonpath_env(), **(env or {})})


def unshare_available() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode == 0


def isolated_argv(argv: Sequence[str], hide: Sequence[Path]) -> list[str]:
    """``argv`` under ``unshare -m`` with an empty tmpfs mounted over each ``hide`` directory.

    ``--propagation private`` keeps these mounts inside the new namespace: the driver's view is unchanged.
    """
    mounts = [f"mount -t tmpfs -o size=256m dpops-hidden {shlex.quote(str(d))}" for d in hide]
    script = " && ".join(mounts + [f"exec {shlex.join(list(argv))}"])
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


def start_worker_pool(log_dir: Path, *, hide: Sequence[Path], env: dict[str, str] | None = None, name: str = "worker_pool") -> Service:
    """An EXTERNAL SDK worker pool (``worker_pool_main``) that cannot see the ``hide`` directories."""
    port = free_port()
    # Each SDK worker is started through a boot script (tests/beam_boot.py) as in Beam's SDK container, so
    # it gets the job's pipeline options (FileSystems needs them for S3). Its wrapper is written to log_dir,
    # which must therefore not be among the hidden directories (like the repo and the venv, it stands for
    # what the worker image holds).
    boot = log_dir / f"{name}-boot.sh"
    log_dir.mkdir(parents=True, exist_ok=True)
    boot.write_text(f"#!/bin/sh\nexec {shlex.quote(PYTHON)} {shlex.quote(str(REPO / 'tests' / 'beam_boot.py'))} \"$@\"\n")
    boot.chmod(0o755)
    argv = [PYTHON, "-m", "apache_beam.runners.worker.worker_pool_main", f"--service_port={port}",
            f"--container_executable={boot}"]
    full_env = {**pythonpath_env(), "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
                **(env or {})}
    # the log goes to a directory the pool does not need to see: it is opened by this (driver) process
    return start(name, isolated_argv(argv, hide), port, log_dir, env=full_env, group=True)


def portable_options(job_port: int, pool_port: int, *, parallelism: int = 1) -> list[str]:
    """PortableRunner options for a local job service and an EXTERNAL worker pool.

    Beam's EXTERNAL environment takes one pool address; ``parallelism`` SDK workers are started from it
    (``--sdk_worker_parallelism``, honoured by tests/beam_job_service.py as by Flink and Spark).
    """
    opts = [f"--job_endpoint=localhost:{job_port}", "--environment_type=EXTERNAL",
            f"--environment_config=localhost:{pool_port}"]
    if parallelism != 1:
        opts.append(f"--sdk_worker_parallelism={parallelism}")
    return opts


def start_moto(log_dir: Path) -> Service:
    """moto's standalone S3 server on 127.0.0.1 (``moto[server]`` from PyPI)."""
    port = free_port()
    exe = shutil.which("moto_server", path=VENV_BIN) or shutil.which("moto_server")
    argv = [exe, "-H", "127.0.0.1", "-p", str(port)] if exe else \
        [PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return start("moto", argv, port, log_dir, env=S3_ENV)


def s3_env(port: int) -> dict[str, str]:
    """The standard S3 client configuration for an endpoint on this machine (boto3 and pyarrow honour it)."""
    return {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


def beam_s3_options(port: int) -> list[str]:
    """Beam's S3 filesystem reads its endpoint from pipeline options (credentials: the provider chain)."""
    return [f"--s3_endpoint_url=http://127.0.0.1:{port}", "--s3_region_name=us-east-1"]


def start_dask(log_dir: Path, n_workers: int = 2, env: dict[str, str] | None = None) -> list[Service]:
    """A Dask scheduler and ``n_workers`` single-threaded worker processes from the ``dask`` CLI."""
    port = free_port()
    dask = shutil.which("dask", path=VENV_BIN) or "dask"
    full = {**pythonpath_env(), **(env or {})}
    services = [start("dask_scheduler", [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                          "--no-dashboard"], port, log_dir, env=full)]
    try:
        for i in range(n_workers):
            wport = free_port()
            services.append(start(f"dask_worker_{i}", [dask, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1",
                                                       "--nworkers", "1", "--no-dashboard", "--listen-address",
                                                       f"tcp://127.0.0.1:{wport}", "--no-nanny"],
                                  wport, log_dir, env=full))
    except BaseException:
        stop_all(services)
        raise
    return services


def stop_all(services: Sequence[Service]) -> None:
    for svc in reversed(list(services)):
        svc.stop()


def iter_logs(services: Sequence[Service]) -> Iterator[str]:
    for svc in services:
        yield f"--- {svc.name} (pid {svc.proc.pid}) ---\n{svc.log_text()}"


@dataclass
class PortableCluster:
    """A job service and one isolated EXTERNAL worker pool (plus a moto S3 server), for one test.

    The driver's directories (``cwd``, ``tmp``, ``out``, ``inp``) are hidden from the pool; ``secrets``
    (the noise key, as a mounted secret) and ``logs`` stay visible.
    """

    base: Path
    job: Service
    pool: Service
    moto: Service | None
    parallelism: int

    @property
    def cwd(self) -> Path:
        return self.base / "driver" / "cwd"

    @property
    def tmp(self) -> Path:
        return self.base / "driver" / "tmp"

    @property
    def out(self) -> Path:
        return self.base / "driver" / "out"

    @property
    def inp(self) -> Path:
        return self.base / "driver" / "in"

    @property
    def secrets(self) -> Path:
        return self.base / "secrets"

    @property
    def env(self) -> dict[str, str]:
        """What the driver needs: S3 endpoint + dummy credentials (standard variables), the tree under test."""
        return {**pythonpath_env(), **(s3_env(self.moto.port) if self.moto else {})}

    def options(self) -> list[str]:
        opts = portable_options(self.job.port, self.pool.port, parallelism=self.parallelism)
        return opts + (beam_s3_options(self.moto.port) if self.moto else [])

    def workers_started(self) -> int:
        """SDK worker processes the pool has started so far (its log line per StartWorker)."""
        return self.pool.log_text(tail=10_000_000).count("Starting worker with command")

    def services(self) -> list[Service]:
        return [s for s in (self.moto, self.job, self.pool) if s is not None]


def driver_dirs(base: Path) -> list[Path]:
    dirs = [base / "driver" / d for d in ("cwd", "tmp", "out", "in")]
    for d in dirs + [base / "secrets", base / "logs"]:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


@contextmanager
def portable_cluster(base: Path, *, parallelism: int = 1, s3: bool = True,
                     moto: Service | None = None) -> Iterator[PortableCluster]:
    """Start moto (if ``s3`` and none is given), a job service and an isolated worker pool; stop what it
    started by PID on exit (a given ``moto`` belongs to the caller)."""
    if not unshare_available():
        raise RuntimeError("unshare -m is not available (needs root and util-linux): the isolated worker pool "
                           "cannot be started")
    hidden = driver_dirs(base)
    logs = base / "logs"
    started: list[Service] = []
    try:
        if moto is None and s3:
            moto = start_moto(logs)
            started.append(moto)
        env = s3_env(moto.port) if moto else {}
        job = start_job_service(logs, env=env)
        started.append(job)
        pool = start_worker_pool(logs, hide=hidden, env=env)
        started.append(pool)
        yield PortableCluster(base, job, pool, moto, parallelism)
    finally:
        stop_all(started)
