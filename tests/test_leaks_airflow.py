"""The leak scan through Airflow (issue 14 "Must show", issue 11 item 3): DAG parsing (import errors and
warnings), ``dag.test`` task runs that succeed and fail, the ``DPOPS_ALERT`` payloads, every log record
(DEBUG and up) and every file the runs leave are searched for the noise key's hex and for sentinels planted
in the input. Only the inputs, the key and the private internal run log (``internal.json``) are exempt.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (sets AIRFLOW_HOME etc. before airflow is imported)

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_support import AIRFLOW_HOME, SPEC_TEMPLATE, SQLITE_URL, airflow_env, make_workspace, migrate_sqlite_db
from test_leaks import assert_no_leaks

pytestmark = pytest.mark.slow

SENT_STR = "SENTINEL-Af3kQ82mZr"
SENT_NUM = "61829374650192"
CHILD = Path(__file__).with_name("leak_airflow_child.py")


def _planted_input(path: Path, hexkey: str) -> None:
    n = 60
    users = [f"u{i}" for i in range(n)] + [SENT_STR, hexkey, "u90", "u91"]
    regions = [f"p{i % 4}" for i in range(n)] + ["p0", "p1", f"{SENT_STR}-region", "p2"]
    # int64 stored, declared float: 2^53 + 1 does not convert exactly, so that row is a malformed cell
    amounts = [i % 50 for i in range(n)] + [int(SENT_NUM), 7, 3, 2**53 + 1]
    cats = ["books"] * n + [SENT_STR, hexkey, "books", "books"]
    pq.write_table(pa.table({"user_id": users, "region": regions, "amount": pa.array(amounts, pa.int64()),
                             "category": cats}), path)


def test_leak_scan_through_airflow(tmp_path, tmp_path_factory):
    migrate_sqlite_db()
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

    # DagBag parsing and dag.test run in a process of their own (tests/leak_airflow_child.py says why); its
    # stdout and stderr are Airflow's task logs (structlog) and the alerts, read here whole.
    result = tmp_path_factory.mktemp("leak-child") / "result.json"
    env = airflow_env(AIRFLOW_HOME, SQLITE_URL, ws.specs_dir, **ws.env(), DPOPS_TASK_RETRIES="0")
    proc = subprocess.run([sys.executable, str(CHILD), str(result), SENT_STR, SENT_NUM], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(result.read_text())
    assert doc["dag_ids"] == ["dpops_af_leak", "dpops_af_leak_input"]  # the public_file one is skipped
    parse_texts = doc["parse_texts"]
    assert "af_leak_public.yaml" in parse_texts and "noise key" in parse_texts
    # [Jan 1, Jan 2) publishes (planted rows dropped or bounded); input.path is the key: refused; a future
    # bug whose text quotes the data fails inside the Beam job
    assert doc["states"] == {"good": "success", "input_is_key": "failed", "leaky_bug": "failed"}, doc["states"]

    out, err = proc.stdout, proc.stderr
    records = doc["records"]
    alerts = [line for line in (out + err).splitlines() if "DPOPS_ALERT {" in line]
    alerts += [r["message"] for r in records if r["message"].startswith("DPOPS_ALERT ")]
    assert len(alerts) >= 2  # the refused input and the failed computation
    assert any("InternalError" in a for a in alerts) and any("noise key" in a for a in alerts)
    texts: dict[str, bytes] = {
        "parse warnings and import errors": parse_texts.encode(),
        "log records": "\n".join(f"{r['name']} {r['message']} {r['exc_text']}" for r in records).encode(),
        "stdout": out.encode(), "stderr": err.encode(),
    }
    for i, r in enumerate(records):  # tracebacks Airflow logs with a task failure, chained causes included
        if r["traceback"]:
            texts[f"traceback in {r['name']} (record {i})"] = r["traceback"].encode()
    assert any(k.startswith("traceback in") for k in texts)  # the failed runs did log their tracebacks
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
