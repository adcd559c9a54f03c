"""The leak scan through Airflow (issue 14 "Must show", issue 11 item 3): DAG parsing (import errors and
warnings), ``dag.test`` task runs that succeed and fail, the ``DPOPS_ALERT`` payloads, every log record
(DEBUG and up) and every file the runs leave are searched for the noise key's hex and for sentinels planted
in the input. Only the inputs, the key and the private internal run log (``internal.json``) are exempt.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (sets AIRFLOW_HOME etc. before airflow is imported)

import logging
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_support import AIRFLOW_HOME, DAGS_FOLDER, SPEC_TEMPLATE, make_workspace, migrate_sqlite_db
from test_leaks import assert_no_leaks

pytestmark = pytest.mark.slow

SENT_STR = "SENTINEL-Af3kQ82mZr"
SENT_NUM = "61829374650192"


@pytest.fixture(autouse=True)
def _restore_logging():
    """dag.test points Airflow's log handlers at the streams capfd captures; once capfd closes them, any later
    test's log line (in a forked CLI run, say) would hit a closed file. Put every logger's handlers back."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    saved = {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}
    yield
    for lg in [logging.getLogger()] + [x for x in logging.Logger.manager.loggerDict.values()
                                       if isinstance(x, logging.Logger)]:
        if lg in saved:
            lg.handlers[:], lg.level, lg.propagate, lg.disabled = saved[lg]
        else:
            lg.handlers[:] = []
            lg.propagate = True


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    import signal

    sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2]
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _planted_input(path: Path, hexkey: str) -> None:
    n = 60
    users = [f"u{i}" for i in range(n)] + [SENT_STR, hexkey, "u90", "u91"]
    regions = [f"p{i % 4}" for i in range(n)] + ["p0", "p1", f"{SENT_STR}-region", "p2"]
    # int64 stored, declared float: 2^53 + 1 does not convert exactly, so that row is a malformed cell
    amounts = [i % 50 for i in range(n)] + [int(SENT_NUM), 7, 3, 2**53 + 1]
    cats = ["books"] * n + [SENT_STR, hexkey, "books", "books"]
    pq.write_table(pa.table({"user_id": users, "region": regions, "amount": pa.array(amounts, pa.int64()),
                             "category": cats}), path)


def test_leak_scan_through_airflow(tmp_path, monkeypatch, caplog, capfd):
    migrate_sqlite_db()
    from airflow.dag_processing.dagbag import DagBag

    ws = make_workspace(tmp_path, release="af_leak", scope="af_leak_scope", days=2)
    hexkey = ws.key_path.read_text().split()[-1]  # the key material line of the v1 file
    for day in ("2024-01-01", "2024-01-02"):
        _planted_input(ws.specs_dir / "data" / f"{day}.parquet", hexkey)
    bad_input = SPEC_TEMPLATE.format(name="af_leak_input", scope=ws.scope, epsilon=0.5, public="p0, p1")
    (ws.specs_dir / "af_leak_input.yaml").write_text(
        bad_input.replace('"data/{start:%Y-%m-%d}.parquet"', f'"{ws.key_path}"'))
    bad_public = SPEC_TEMPLATE.format(name="af_leak_public", scope=ws.scope, epsilon=0.5, public="p0")
    (ws.specs_dir / "af_leak_public.yaml").write_text(
        bad_public.replace("  public: [p0]", f"  public_file: {ws.key_path}"))

    for k, v in ws.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DPOPS_TASK_RETRIES", "0")
    caplog.set_level(logging.DEBUG)
    bag = DagBag(dag_folder=str(DAGS_FOLDER))
    assert sorted(bag.dag_ids) == ["dpops_af_leak", "dpops_af_leak_input"]  # the public_file one is skipped
    parse_texts = " ".join(str(w) for ws_ in bag.captured_warnings.values() for w in ws_)
    parse_texts += " ".join(map(str, bag.import_errors.values()))
    assert "af_leak_public.yaml" in parse_texts and "noise key" in parse_texts

    def day(d: int) -> datetime:
        return datetime(2024, 1, d, tzinfo=timezone.utc)

    good = bag.dags["dpops_af_leak"]
    dr = good.test(logical_date=day(2))  # [Jan 1, Jan 2): publishes, planted rows dropped or bounded
    assert dr.state == "success"
    dr = bag.dags["dpops_af_leak_input"].test(logical_date=day(2))  # input.path is the key: refused
    assert dr.state == "failed"
    import pipelines.io as pio  # the read transform looks prepare_batch up on pipelines.io at run time

    def leaky_prepare(batch, *a, **k):  # a future bug whose text quotes the data
        raise ValueError(f"Could not convert {SENT_STR} {SENT_NUM} {hexkey}")

    monkeypatch.setattr(pio, "prepare_batch", leaky_prepare)
    dr = good.test(logical_date=day(3))  # [Jan 2, Jan 3): fails inside the Beam job
    assert dr.state == "failed"
    monkeypatch.undo()

    out, err = capfd.readouterr()  # Airflow's task logs (structlog) and the alerts go to the terminal here
    alerts = [line for line in (out + err).splitlines() if "DPOPS_ALERT {" in line]
    alerts += [r.getMessage() for r in caplog.records if r.getMessage().startswith("DPOPS_ALERT ")]
    assert len(alerts) >= 2  # the refused input and the failed computation
    assert any("InternalError" in a for a in alerts) and any("noise key" in a for a in alerts)
    texts: dict[str, bytes] = {
        "parse warnings and import errors": parse_texts.encode(),
        "log records": "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records).encode(),
        "stdout": out.encode(), "stderr": err.encode(),
    }
    for r in caplog.records:  # tracebacks Airflow logs with a task failure, chained causes included
        if r.exc_info and r.exc_info[1] is not None:
            import traceback

            texts[f"traceback in {r.name}"] = "".join(traceback.format_exception(r.exc_info[1])).encode()
    exempt = {(ws.specs_dir / "data").resolve()}
    for base in (tmp_path, AIRFLOW_HOME / "logs"):
        for f in sorted(Path(base).rglob("*")) if Path(base).exists() else []:
            if f.is_symlink() or not f.is_file() or f.resolve() == ws.key_path.resolve():
                continue
            if any(p in exempt for p in f.resolve().parents) or f.name == "internal.json":
                continue
            texts[str(f)] = f.read_bytes()
    assert any("published.json" in k for k in texts)
    needles = {"key hex": hexkey, "key hex prefix": hexkey[:24], "sentinel string": SENT_STR,
               "sentinel number": SENT_NUM, "2^53+1": str(2**53 + 1)}
    assert_no_leaks(texts, needles)
