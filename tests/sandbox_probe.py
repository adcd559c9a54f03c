"""Run INSIDE ``dpops.sandbox.run_confined`` by tests/test_gx_sandbox.py: try what a hostile suite would.

Reads ``{"key": path, "input": path, "outside": path, "port": int, "gx": bool}`` on stdin and answers
with what each attempt gave. With ``gx`` it also runs GX's own pandas ``row_condition`` path (the
issue 19 item 5 exploit) against the key, so the test proves the code path stays harmless even if a
row condition ever reached GX in the sandbox.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from dpops.sandbox import write_result


def _try(fn):
    try:
        return ["ok", repr(fn())[:200]]
    except BaseException as exc:  # noqa: BLE001 - the probe reports every failure
        return ["err", f"{type(exc).__name__}: {exc}"[:300]]


def _gx_row_condition(key: str, scratch: Path) -> dict[str, object]:
    import great_expectations as gx
    import great_expectations.expectations as gxe
    import pandas as pd

    out, py_out = scratch / "copied_by_shell", scratch / "copied_by_python"
    ctx = gx.get_context(mode="ephemeral")
    batch = ctx.data_sources.add_pandas("p").add_dataframe_asset("a").add_batch_definition_whole_dataframe("b")
    exps = [
        gxe.ExpectColumnValuesToBeBetween(column="count", min_value=0, condition_parser="pandas",
                                          row_condition=f"index >= @pd.io.common.os.system('cat {key} > {out}')"),
        gxe.ExpectColumnValuesToBeBetween(column="count", min_value=0, condition_parser="pandas",
                                          row_condition=f"index >= @pd.read_csv('{key}', header=None, sep='|').to_csv('{py_out}')"),
    ]
    suite = ctx.suites.add(gx.ExpectationSuite(name="s", expectations=exps))
    vd = ctx.validation_definitions.add(gx.ValidationDefinition(name="v", data=batch, suite=suite))
    res = vd.run(batch_parameters={"dataframe": pd.DataFrame({"count": [1.0, 2.0]})})
    del res  # GX records the payloads' exceptions; what matters is what they could copy

    def copied(p: Path) -> str | None:
        return p.read_bytes().decode("latin-1") if p.exists() else None

    return {"shell_copy": copied(out), "python_copy": copied(py_out)}


def _udp(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return s.sendto(b"from the sandbox", ("127.0.0.1", port))


def _udp6(port: int) -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        return s.sendto(b"from the sandbox", ("::1", port))


def _unix(address: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(address)
        s.sendall(b"from the sandbox")


def main() -> None:
    job = json.loads(sys.stdin.read())
    fds = []
    for fd in range(64):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            pass
    res: dict[str, object] = {
        "uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups(), "env": sorted(os.environ), "fds": fds,
        "read_key": _try(lambda: open(job["key"], "rb").read()),
        "read_input": _try(lambda: open(job["input"], "rb").read(16)),
        "list_input_dir": _try(lambda: os.listdir(os.path.dirname(job["input"]))),
        "write_outside": _try(lambda: open(job["outside"], "w").write("x")),
        "tcp_connect": _try(lambda: socket.create_connection(("127.0.0.1", job["port"]), timeout=5).close()),
    }
    if job.get("udp_port"):  # issue 25 item 11: Landlock alone let UDP and Unix sockets through
        res["udp_send"] = _try(lambda: _udp(job["udp_port"]))
        res["udp6_send"] = _try(lambda: _udp6(job["udp_port"]))
        res["unix_connect"] = _try(lambda: _unix(job["unix_path"]))
        res["abstract_unix_connect"] = _try(lambda: _unix("\0" + job["abstract_name"]))
        res["netlink_socket"] = _try(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close())
        res["packet_socket"] = _try(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close())
        res["socketpair"] = _try(lambda: [s.close() for s in socket.socketpair()])
    if job.get("gx"):
        res["gx"] = _gx_row_condition(job["key"], Path.cwd())
    write_result(res)


if __name__ == "__main__":
    main()
