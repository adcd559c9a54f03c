"""Validate a Beam runner, its options and its endpoints before the ledger starts a run.

``dpops.release.computation`` calls :func:`check_runner` (imported lazily by its dotted name, like the
pipeline itself, so ``dpops`` never imports Beam) before ``ledger.reserve`` and again right
before ``ledger.start``. Why: an os-mode run is charged as soon as it starts, and a typo in
``--runner`` or a dead ``--job_endpoint`` used to surface only after that (a dead endpoint
blocked for minutes). Everything here runs on the driver, draws no noise, reads no input and
is bounded in time: a failure costs nothing and says what to fix.

Checks, in order:

1. The runner name is one Beam accepts: a name from ``StandardOptions.ALL_KNOWN_RUNNERS``
   (matched the way Beam's ``create_runner`` does: case-insensitive, ``Runner`` suffix
   optional), a runner Beam ships but does not list (``DaskRunner``), or the dotted path of a
   ``PipelineRunner`` subclass. Its module is imported, so a runner whose extra is missing
   (``DataflowRunner`` without ``apache-beam[gcp]``) fails here and not after ``start``.
2. The options parse with Beam's own parser (every ``PipelineOptions`` subclass, including the
   runner's, e.g. ``DaskOptions``). Beam itself only logs "Discarding unparseable args" for an
   unknown flag and goes on; a misspelt ``--job_endpont`` would then silently fall back to a
   default, so an unknown flag is refused here.
3. Endpoints answer: ``--job_endpoint`` (PortableRunner, FlinkRunner, SparkRunner) must complete a
   gRPC connect (TCP and HTTP/2 handshake) within the timeout, so a dead port and a black hole (a
   socket that accepts and never answers) both fail in bounded time. An EXTERNAL
   ``--environment_config=host:port`` worker pool is probed the same way when both it and the job
   endpoint are loopback addresses (a local job service dials the pool from this machine's
   network, as the driver does); on a cluster the pool is addressed from the runner's side (a
   sidecar on each task manager) and the driver cannot probe it. A Dask scheduler
   (``--dask_client_address``) must accept a TCP connect.

Privacy/secrecy: messages name flags, runners and host:port endpoints only, never an option's
value otherwise (``--s3_secret_access_key=...`` may be among the options).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import re
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dpops.errors import RunnerError

CONNECT_TIMEOUT_ENV = "DPOPS_RUNNER_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 10.0

# Runners Beam ships but does not list in StandardOptions.ALL_KNOWN_RUNNERS (so ``--runner=DaskRunner``
# fails inside Beam); they are passed on by their dotted path.
EXTRA_RUNNERS = ("apache_beam.runners.dask.dask_runner.DaskRunner",)
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0")


@dataclass(frozen=True)
class CheckedRunner:
    """The runner as the pipeline should pass it to Beam, and what was probed."""

    runner: str  # the name given if Beam knows it, else the dotted path of the runner class
    runner_class: str  # the runner's class name, e.g. "PortableRunner"
    probed: tuple[str, ...]  # "job_endpoint localhost:8099", ...


def connect_timeout() -> float:
    raw = os.environ.get(CONNECT_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_CONNECT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise RunnerError(f"{CONNECT_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= 600:
        raise RunnerError(f"{CONNECT_TIMEOUT_ENV} must be in (0, 600] seconds, got {value}")
    return value


def known_runners() -> dict[str, str]:
    """Lower-case short name -> dotted path, from Beam's own list plus the runners it ships unlisted."""
    from apache_beam.options.pipeline_options import StandardOptions

    paths = tuple(StandardOptions.ALL_KNOWN_RUNNERS) + EXTRA_RUNNERS
    return {p.rsplit(".", 1)[-1].lower(): p for p in paths}


def _beam_listed(short_lower: str) -> bool:
    from apache_beam.options.pipeline_options import StandardOptions

    return any(p.rsplit(".", 1)[-1].lower() == short_lower for p in StandardOptions.ALL_KNOWN_RUNNERS)


def resolve_runner(name: str) -> tuple[str, type]:
    """(name to give Beam, runner class) for ``name``; RunnerError if Beam has no such runner."""
    from apache_beam.runners.runner import PipelineRunner

    if not name or not name.strip():
        raise RunnerError("no Beam runner given: pass --runner (e.g. FnApiRunner, PortableRunner, FlinkRunner)")
    table = known_runners()
    key = name.strip().lower()
    path = table.get(key) or table.get(key + "runner")
    if path is None and "." not in name:
        listed = ", ".join(sorted(p.rsplit(".", 1)[-1] for p in table.values()))
        raise RunnerError(f"unknown Beam runner {name!r}: Beam accepts {listed}, or the dotted path of a "
                          "PipelineRunner subclass; fix --runner. Nothing was reserved or charged")
    target = path or name
    module_name, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        hint = ""
        if "dataflow" in target.lower():
            hint = " (install apache-beam[gcp])"
        elif "dask" in target.lower():
            hint = " (install dask[distributed])"
        raise RunnerError(f"Beam runner {name!r} ({target}) cannot be loaded: {type(exc).__name__}{hint}; "
                          "install its extra or pick another runner. Nothing was reserved or charged") from None
    if not (isinstance(cls, type) and issubclass(cls, PipelineRunner)):
        raise RunnerError(f"{target} is not a Beam PipelineRunner subclass; fix --runner")
    given = name if path is not None and _beam_listed(path.rsplit(".", 1)[-1].lower()) else target
    return given, cls


_ARG_IN_ERROR = re.compile(r"argument (--?[A-Za-z0-9_\-]+)")


def parse_options(runner_options: Sequence[str]) -> dict[str, object]:
    """Parse with Beam's parser (all PipelineOptions subclasses loaded so far); refuse unknown flags.

    Beam drops unknown flags with a warning; argparse exits (SystemExit 2) on a bad value. Both
    become a RunnerError naming the flag only.
    """
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = list(runner_options)
    for f in flags:
        if f.split("=", 1)[0] in ("--runner", "-runner"):
            raise RunnerError("give the runner with --runner, not inside the runner options (--runner-option "
                              "--runner=...): the two could disagree")
    parsers: list[object] = []
    err = io.StringIO()
    beam_log = logging.getLogger("apache_beam.options.pipeline_options")
    try:
        # Beam logs the discarded flags WITH their values ("Discarding unparseable args: [...]"), and a
        # value may be a secret: its logger is silenced while we parse (we report the flag names).
        with contextlib.redirect_stderr(err), _silenced(beam_log):
            values = PipelineOptions(flags).get_all_options(add_extra_args_fn=parsers.append)
            _, unknown = parsers[0].parse_known_args(flags)  # type: ignore[attr-defined]
    except SystemExit:
        m = _ARG_IN_ERROR.search(err.getvalue())
        what = f"option {m.group(1)}" if m else "a runner option"
        raise RunnerError(f"{what} has an invalid or missing value (Beam's option parser refused it); fix the "
                          "--runner-option values. Nothing was reserved or charged") from None
    names = sorted({u.split("=", 1)[0] for u in unknown if u.startswith("-")})
    if names or unknown:
        shown = ", ".join(names) if names else "a value without a flag"
        raise RunnerError(f"unknown Beam pipeline option(s) {shown}: Beam would silently ignore them; check the "
                          "spelling (Beam options use underscores, e.g. --job_endpoint) or the runner's extra. "
                          "Nothing was reserved or charged")
    return values


@contextlib.contextmanager
def _silenced(logger: logging.Logger) -> Iterator[None]:
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


def _split_host_port(endpoint: str, what: str) -> tuple[str, int]:
    target = endpoint.strip()
    for prefix in ("grpc://", "tcp://", "dns:///", "dns:"):
        target = target.removeprefix(prefix)
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RunnerError(f"{what} {endpoint!r} is not host:port; fix the runner option")
    return host.strip("[]") if host.startswith("[") else host, int(port)


def probe_grpc(endpoint: str, what: str, timeout: float) -> None:
    """A gRPC channel to ``endpoint`` becomes READY within ``timeout`` s, else RunnerError.

    READY needs the TCP connect and the HTTP/2 settings exchange, so a socket that accepts and never
    speaks (a black hole, a wrong service) fails like a closed port.
    """
    import grpc

    host, port = _split_host_port(endpoint, what)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # A refused port fails at once here; gRPC alone would keep retrying until the timeout.
    probe_tcp(endpoint, what, timeout)
    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        raise RunnerError(f"{what} {target} did not answer a gRPC connect within {timeout:g} s (nothing listening, "
                          f"or not a gRPC service): start it or fix the endpoint ({CONNECT_TIMEOUT_ENV} sets the "
                          "timeout). Nothing was reserved or charged") from None
    finally:
        channel.close()


def probe_tcp(endpoint: str, what: str, timeout: float) -> None:
    host, port = _split_host_port(endpoint, what)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise RunnerError(f"{what} {host}:{port} refused or did not accept a TCP connect within {timeout:g} s "
                          f"({type(exc).__name__}): start it or fix the address. Nothing was reserved or "
                          "charged") from None


def _is_loopback(endpoint: str) -> bool:
    try:
        host, _ = _split_host_port(endpoint, "endpoint")
    except RunnerError:
        return False
    return host in _LOOPBACK or host.startswith("127.")


def check_runner(runner: str, runner_options: Sequence[str] = ()) -> CheckedRunner:
    """Refuse (RunnerError, exit 6) an unknown runner, an unparseable option or a silent endpoint.

    Returns the runner name to hand to Beam: unchanged if Beam lists it, else its dotted path
    (``DaskRunner`` -> ``apache_beam.runners.dask.dask_runner.DaskRunner``).
    """
    timeout = connect_timeout()
    given, cls = resolve_runner(runner)
    values = parse_options(runner_options)  # after the import: the runner's own options are known
    name = cls.__name__
    probed: list[str] = []
    job_endpoint = values.get("job_endpoint")
    if name == "PortableRunner" and not job_endpoint:
        raise RunnerError("PortableRunner needs --job_endpoint=HOST:PORT (a running Beam job service); "
                          "nothing was reserved or charged")
    # PortableRunner and its subclasses (FlinkRunner, SparkRunner) submit to the job service at --job_endpoint.
    # Without one, Flink/Spark start a job-server jar themselves (fetched from Maven): not probed here.
    if job_endpoint and issubclass_by_name(cls, "PortableRunner"):
        probe_grpc(str(job_endpoint), f"{name} job endpoint", timeout)
        probed.append(f"job_endpoint {job_endpoint}")
        env_type = str(values.get("environment_type") or "").upper()
        env_config = values.get("environment_config")
        if env_type == "EXTERNAL" and env_config and _is_loopback(str(job_endpoint)) \
                and _is_loopback(str(env_config)):
            probe_grpc(str(env_config), "EXTERNAL SDK worker pool (--environment_config)", timeout)
            probed.append(f"environment_config {env_config}")
    dask_address = values.get("address") if name == "DaskRunner" else None  # --dask_client_address
    if dask_address:
        probe_tcp(str(dask_address), "Dask scheduler (--dask_client_address)", timeout)
        probed.append(f"dask_client_address {dask_address}")
    return CheckedRunner(runner=given, runner_class=name, probed=tuple(probed))


def issubclass_by_name(cls: type, base_name: str) -> bool:
    return any(b.__name__ == base_name for b in cls.__mro__)
