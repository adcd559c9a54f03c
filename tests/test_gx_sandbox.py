"""Issue 19 item 5 (b): the GX sandbox child cannot read the noise key or the private inputs.

Not a mock: ``tests/sandbox_probe.py`` runs through the very launcher the GX checkpoint uses
(``dpops.sandbox.run_confined``: fresh environment, closed descriptors, Landlock, uid 65534 where the
interpreter allows it) and tries what a hostile suite would, including GX's own pandas
``row_condition`` path that the issue's exploit used.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dpops.noise.randomness import NoiseKey
from dpops.sandbox import landlock_abi, planned_confinement, run_confined

pytestmark = pytest.mark.skipif(not landlock_abi(), reason="this kernel has no Landlock; team suites are refused there")
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    key = tmp_path / "secrets" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    data = tmp_path / "data" / "2024-01-01.csv"
    data.parent.mkdir()
    data.write_text("user_id,region\nalice,north\n")
    data.chmod(0o644)  # world-readable on purpose: a dropped uid alone would not protect it
    monkeypatch.setenv("DPOPS_NOISE_KEY_FILE", str(key))
    monkeypatch.setenv("DPOPS_LEDGER_URL", "postgresql://app:secret@127.0.0.1/ledger")
    return key, data, tmp_path


def _probe(tmp_path, key, data, port, *, gx=False, drop_uid=True):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    job = {"key": str(key), "input": str(data), "outside": str(tmp_path / "written_outside"), "port": port, "gx": gx}
    with open(key, "rb"):  # the parent holds the key open: the child must not inherit the descriptor
        res = run_confined("sandbox_probe", json.dumps(job).encode(), scratch, extra_path=[TESTS], timeout=300,
                           drop_uid=drop_uid)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    return json.loads(res.stdout), res


@pytest.mark.parametrize("drop_uid", [True, False], ids=["as-planned", "same-uid"])
def test_child_cannot_read_key_or_inputs_nor_connect(secrets, drop_uid):
    key, data, tmp = secrets
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        # control: the parent itself can do all of it
        assert key.read_bytes() and data.read_text().startswith("user_id")
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        out, res = _probe(tmp, key, data, port, drop_uid=drop_uid)
    for attempt in ("read_key", "read_input", "list_input_dir", "write_outside", "tcp_connect"):
        assert out[attempt][0] == "err" and "Permission denied" in out[attempt][1], (attempt, out[attempt])
    assert not (tmp / "written_outside").exists()
    assert not [v for v in out["env"] if v.startswith("DPOPS_")]  # no key reference, no ledger URL
    assert out["fds"] == [0, 1, 2, 3]  # its three pipes and the answer's duplicate: no key descriptor
    if drop_uid and res.confinement.uid is not None:
        assert out["uid"] == out["euid"] == 65534 and out["groups"] == []


@pytest.mark.parametrize("drop_uid", [True, False], ids=["as-planned", "same-uid"])
def test_child_reaches_no_udp_unix_or_netlink_socket(secrets, drop_uid):
    """Issue 25 item 11: Landlock mediates only TCP; the child reached UDP and the ledger's PostgreSQL Unix
    socket. Now it has its own empty network namespace and may create only AF_INET/AF_INET6 sockets: UDP
    (v4, v6) has no route, pathname and abstract Unix sockets, netlink and packet sockets cannot be created,
    and the parent's listeners (which the parent itself reaches: the control) receive nothing."""
    import os
    import secrets as pysecrets

    key, data, tmp = secrets
    sock_dir = tmp / "run"
    sock_dir.mkdir()
    os.chmod(sock_dir, 0o777)
    unix_path = str(sock_dir / ".s.PGSQL.5432")
    abstract = f"dpops-test-{pysecrets.token_hex(6)}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
            socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as udp6, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as abstract_sock:
        udp.bind(("127.0.0.1", 0))
        port = udp.getsockname()[1]
        udp6.bind(("::1", port))
        unix.bind(unix_path)
        os.chmod(unix_path, 0o777)
        unix.listen(1)
        abstract_sock.bind("\0" + abstract)
        abstract_sock.listen(1)
        for s in (udp, udp6, unix, abstract_sock):
            s.setblocking(False)
        # control: from the parent, each listener is reachable
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
            c.sendto(b"control", ("127.0.0.1", port))
        assert udp.recv(64) == b"control"
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(unix_path)
            unix.accept()[0].close()
        scratch = tmp / "scratch"
        scratch.mkdir()
        job = {"key": str(key), "input": str(data), "outside": str(tmp / "written_outside"), "port": 9,
               "udp_port": port, "unix_path": unix_path, "abstract_name": abstract}
        res = run_confined("sandbox_probe", json.dumps(job).encode(), scratch, extra_path=[TESTS], timeout=300,
                           drop_uid=drop_uid)
        assert res.returncode == 0, res.stderr.decode()[-3000:]
        out = json.loads(res.stdout)
        for s in (udp, udp6):
            with pytest.raises(BlockingIOError):
                s.recv(64)
        for s in (unix, abstract_sock):
            with pytest.raises(BlockingIOError):
                s.accept()
    for attempt in ("udp_send", "udp6_send", "unix_connect", "abstract_unix_connect", "netlink_socket",
                    "packet_socket"):
        assert out[attempt][0] == "err", (attempt, out[attempt])
    for attempt in ("unix_connect", "abstract_unix_connect", "netlink_socket", "packet_socket"):
        assert "Permission denied" in out[attempt][1], (attempt, out[attempt])  # the socket-family filter
    assert "unreachable" in out["udp_send"][1] or "Permission denied" in out["udp_send"][1], out["udp_send"]
    assert out["socketpair"][0] == "ok"  # connects the child to itself only: allowed


def test_network_isolation_is_available_here_and_its_filter_is_deny_by_default():
    """This machine (root, Linux x86_64/arm64) can build the isolation; the filter lets only AF_INET(6) through."""
    from dpops.sandbox import ALLOWED_SOCKET_FAMILIES, network_isolation_available

    assert network_isolation_available() is None
    assert set(ALLOWED_SOCKET_FAMILIES) == {socket.AF_INET, socket.AF_INET6}


def test_gx_row_condition_path_in_the_child_reaches_nothing(secrets, tmp_path):
    """Even if a row_condition ever got past dpops' validator, GX evaluating it in the sandbox reads no key."""
    key, data, tmp = secrets
    out, _ = _probe(tmp, key, data, 9, gx=True)
    assert out["gx"]["shell_copy"] == ""  # the shell ran, `cat` could not open the key
    assert out["gx"]["python_copy"] is None  # pandas could not open it


def test_the_same_gx_payload_does_read_a_file_outside_the_sandbox(tmp_path):
    """Control for the test above: unconfined, the exploit payload really copies the file."""
    from sandbox_probe import _gx_row_condition

    secret = tmp_path / "not_a_key"
    secret.write_text("visible outside the sandbox")
    got = _gx_row_condition(str(secret), tmp_path)
    assert got["shell_copy"] == "visible outside the sandbox" and "visible outside the sandbox" in got["python_copy"]


def test_planned_confinement_is_reported():
    plan = planned_confinement()
    assert plan.landlock >= 1 and "Landlock ABI" in plan.describe()


def test_team_suites_are_refused_before_reservation_where_no_network_isolation_can_be_built(tmp_path, monkeypatch):
    """Degrade to a clear refusal, never to an open network: where unshare/seccomp are not allowed (a container
    without CAP_SYS_ADMIN or user namespaces), ``preflight`` (run before the reservation) refuses the suites."""
    import dpops.gx_project as gx_project
    from dpops.errors import SpecError

    root = tmp_path / "proj"
    gx_project.ensure_project(root)
    suite = root / "gx" / "expectations" / "output" / "all" / "big.json"
    suite.parent.mkdir(parents=True)
    suite.write_text(json.dumps({"name": "output.all.big", "expectations": [
        {"type": "expect_column_min_to_be_between", "kwargs": {"column": "count", "min_value": 0}}]}))
    assert [s.name for s in gx_project.preflight(root, "r")] == ["output.all.big"]  # here it can be built
    monkeypatch.setattr(gx_project, "network_isolation_available",
                        lambda: "unshare(CLONE_NEWNET) failed (Operation not permitted)")
    with pytest.raises(SpecError, match="sandbox without network.*Operation not permitted"):
        gx_project.preflight(root, "r")
