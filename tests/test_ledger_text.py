"""Issue 19 item 11: small leaks.

- A ledger URL with credentials in its query (``?password=``, libpq form) never reaches an error, a signed
  checkpoint (0644) or the report: ``dpops.ledger.backend.redact`` is the one redaction.
- Control characters (terminal escapes, bidi overrides) in ``--reason``, ``--actor`` and scope descriptions are
  refused at write time; old entries holding them are printed escaped by ``ledger history``.
- Issue 25 item 11: a password holding ``/``, ``?``, ``#`` or ``@`` (raw or percent-encoded) is never shown;
  raw, it is refused before connecting, with what to do.
- ``dpops report --manifests s3://...`` reads the manifests from the object store (the option used to turn
  ``s3://`` into ``s3:/``).
"""

from __future__ import annotations

import json
import uuid
from urllib.parse import quote

import psycopg
import pytest
from hypothesis import given, settings
from fuzz_support import examples
from hypothesis import strategies as st

from dpops.cli.main import main
from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeDefinition, open_ledger
from dpops.ledger import store as store_mod
from dpops.ledger.backend import redact
from dpops.manifest import write_manifest
from dpops.manifest.sign import generate_signing_key
from manifest_support import make_ledger, run_key, synthetic_events, synthetic_manifest

SENTINEL = "Sentinel7Pw"
ESC = "\x1b[2K\x1b[1A"  # erase the line, cursor up: how a cap raise was hidden


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def scope_def(name="s", epsilon=1.0, description=""):
    return ScopeDefinition(name=name, unit="a user's events", unit_column="user_id", epsilon=epsilon, delta=1e-6,
                           rho=None, accountant="basic", adjacency="add_remove", description=description)


@pytest.mark.parametrize("url, shown, public", [
    ("postgresql://app:pw1@db:5432/l?schema=dpops&password=pw2&sslmode=require",
     "postgresql://app:***@db:5432/l?schema=dpops&password=***&sslmode=require", "postgresql://db:5432/l?schema=dpops&sslmode=require"),
    ("postgresql://app@db/l?passfile=/run/pgpass&sslpassword=k&sslkey=/k.pem&SSLPASSWORD=x",
     "postgresql://app@db/l?passfile=***&sslpassword=***&sslkey=***&SSLPASSWORD=***", "postgresql://db/l"),
    ("postgresql:///l?host=/var/run/postgresql&password=pw", "postgresql:///l?host=/var/run/postgresql&password=***",
     "postgresql:///l?host=/var/run/postgresql"),
    ("sqlite:////var/lib/dpops/l.sqlite", "sqlite:////var/lib/dpops/l.sqlite", "sqlite:////var/lib/dpops/l.sqlite"),
])
def test_redact_hides_every_credential(url, shown, public):
    assert redact(url) == shown and redact(url, public=True) == public


# Issue 25 item 11: a password holding '/', '?' or '#' printed in full (a URL parser ends the authority there).
_PW_CHARS = list("/?#@:%&=+ ;,[]abcXYZ09!$'()*~-._") + ["\u00e9", "\\"]


@settings(max_examples=examples(300), deadline=None)
@given(pw=st.text(alphabet=st.sampled_from(_PW_CHARS), min_size=1, max_size=12), encoded=st.booleans(),
       form=st.sampled_from(["postgresql://alice:{pw}@db.example:5432/ledger?schema=dpops",
                             "postgres://alice:{pw}@db.example/ledger",
                             "postgresql+psycopg://alice:{pw}@db.example:5432/ledger?sslmode=require"]))
def test_redact_never_shows_a_password_whatever_characters_it_holds(pw, encoded, form):
    """Exact display for any password, raw or percent-encoded: the user, ``:***``, then host, database and the
    non-secret options; ``public=True`` without the user. (False-failure rate 0: deterministic.)"""
    written = quote(pw, safe="") if encoded else pw
    url = form.format(pw=written)
    scheme, rest = form.split("://")
    location = rest.split("@", 1)[1]
    assert redact(url) == f"{scheme}://alice:***@{location}"
    assert redact(url, public=True) == f"{scheme}://{location}"


@pytest.mark.postgres
def test_a_password_with_url_delimiters_connects_encoded_and_is_refused_raw(postgres_url, capsys):
    """Raw: refused before any connection with what to do, the password not shown. Percent-encoded: connects
    (the test server trusts local connections: the password itself is not checked)."""
    secret = f"{SENTINEL}/x?y#z@w"
    raw = postgres_url.replace("postgres@", f"postgres:{secret}@")
    code, out, err = cli(capsys, "ledger", "--ledger", raw, "status", "s")
    assert code == 6 and "percent-encoded" in err and "%2F" in err, err
    assert SENTINEL not in out + err and "x?y" not in out + err
    encoded = postgres_url.replace("postgres@", f"postgres:{quote(secret, safe='')}@")
    schema = f"t_pwchars_{uuid.uuid4().hex[:8]}"
    try:
        with open_ledger(f"{encoded}?schema={schema}") as led:
            assert led.db.row("SELECT current_user")[0] == "postgres" and SENTINEL not in redact(led.url)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_query_password_never_reaches_an_error(capsys, tmp_path):
    url = f"sqlite:///{tmp_path}/l.sqlite?password={SENTINEL}"
    code, out, err = cli(capsys, "ledger", "--ledger", url, "init")
    assert code == 6 and "password=***" in err and SENTINEL not in out + err


@pytest.mark.postgres
def test_a_query_password_never_reaches_an_error_checkpoint_or_report(postgres_url, capsys, tmp_path):
    code, out, err = cli(capsys, "ledger", "--ledger",
                         postgresql_db(postgres_url, f"no_such_db_{uuid.uuid4().hex[:8]}") + f"?password={SENTINEL}",
                         "status", "s")
    assert code == 6 and SENTINEL not in out + err
    schema = f"t_redact_{uuid.uuid4().hex[:10]}"
    url = postgres_url.replace("postgres@", f"postgres:{SENTINEL}a@") + \
        f"?schema={schema}&password={SENTINEL}b&sslmode=prefer"
    priv, pub = tmp_path / "cp.key", tmp_path / "cp.pub"
    generate_signing_key(priv, pub)
    try:
        with open_ledger(url) as led:
            led.create_scope(scope_def(), actor="owner")
        code, out, err = cli(capsys, "ledger", "--ledger", url, "checkpoint", "--dir", str(tmp_path / "cps"),
                             "--signing-key", str(priv))
        assert code == 0, err
        (cp,) = (tmp_path / "cps").iterdir()
        text = cp.read_text()
        assert SENTINEL not in text + out + err
        assert json.loads(text)["ledger"] == f"postgresql://127.0.0.1:5432/test?schema={schema}&sslmode=prefer"
        code, out, err = cli(capsys, "report", "--ledger", url, "--scope", "s", "--out", str(tmp_path / "r.html"))
        assert SENTINEL not in (tmp_path / "r.html").read_text() + out + err
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def postgresql_db(base: str, db: str) -> str:
    return base.rsplit("/", 1)[0] + "/" + db


def test_control_characters_are_refused_at_write_time(capsys, tmp_path):
    url = f"sqlite:///{tmp_path}/l.sqlite"
    with open_ledger(url) as led:
        led.create_scope(scope_def(), actor="owner")
        before = len(led.history())
    attempts = {
        "reason": ["cap", "s", "--epsilon", "1000", "--reason", f"ok{ESC}", "--actor", "alice"],
        "actor": ["cap", "s", "--epsilon", "1000", "--reason", "ok", "--actor", f"alice{ESC}"],
        "description": ["scope", "create", "t", "--unit", "u", "--unit-column", "user_id", "--epsilon", "1",
                        "--delta", "0", "--accountant", "basic", "--adjacency", "add_remove",
                        "--description", "fine\u202eenif"],
        "unit": ["scope", "create", "t", "--unit", "u\nv", "--unit-column", "user_id", "--epsilon", "1",
                 "--delta", "0", "--accountant", "basic", "--adjacency", "add_remove"],
    }
    for field, argv in attempts.items():
        code, out, err = cli(capsys, "ledger", "--ledger", url, *argv)
        assert code == 3 and field in err and "control character" in err, (field, err)
        assert "\x1b" not in err and "\u202e" not in err  # the error never echoes the text
    with open_ledger(url) as led:
        assert len(led.history()) == before and [s.name for s in led.scopes()] == ["s"]


def test_old_entries_with_escapes_are_printed_escaped(capsys, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/l.sqlite"
    monkeypatch.setattr(store_mod, "check_free_text", lambda value, field: value)  # as written before the fix
    with open_ledger(url) as led:
        led.create_scope(scope_def(epsilon=10.0), actor="owner")
        led.change_cap("s", epsilon=1000.0, reason=f"typo{ESC}cap unchanged", actor=f"alice{ESC}")
        led.reserve(RunKey("r", "h", "2024-03-01T00:00:00Z", "2024-03-02T00:00:00Z", "fp", "k"), "s",
                    [Laplace(scale=1.0, l1_sensitivity=1.0)], actor="op\u202e")
    monkeypatch.undo()
    for columns in ("200", "60"):  # the table and the `column: value` fallback
        monkeypatch.setenv("COLUMNS", columns)
        code, out, _ = cli(capsys, "ledger", "--ledger", url, "history")
        assert code == 0
        assert "\x1b" not in out and "\u202e" not in out
        assert "\\x1b[2K" in out and "\\u202e" in out
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "history", "--json")
    assert "\x1b" not in out and json.loads(out)["entries"][1]["actor"] == f"alice{ESC}"  # JSON keeps the truth


def test_report_reads_manifests_from_an_object_store(s3, tmp_path, capsys):  # noqa: F811
    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=10.0)
    mdir = tmp_path / "manifests"
    for i in range(3):
        key = run_key("daily_a", i)
        rec = ledger.reserve(key, "purchases", synthetic_events(), actor="t")
        ledger.start(rec.run_id, actor="t")
        ledger.commit(rec.run_id, output_uri=f"file:///out/{i}", actor="t")
        write_manifest(synthetic_manifest("published", key=key), mdir)
    ledger.close()
    client = s3.client()
    for p in sorted(mdir.rglob("*.json")):
        client.upload_file(str(p), s3.bucket, f"manifests/{p.relative_to(mdir)}")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    results = {}
    for where in (str(mdir), s3.uri("manifests")):
        code, out, err = cli(capsys, "report", "--ledger", url, "--scope", "purchases", "--manifests", where,
                             "--out", str(tmp_path / "r.html"), "--json")
        assert "s3:/" + s3.bucket not in err and "does not exist" not in err, err
        doc = json.loads(out)
        results[where] = (code, len(doc.get("manifests_failed", [])))
        assert (tmp_path / "r.html").read_text().count("<tr") > 3
    local, remote = results.values()
    assert local == remote and local[1] == 3  # the same verdicts (the synthetic manifests' stub plans fail)
    code, out, err = cli(capsys, "report", "--ledger", url, "--scope", "purchases", "--manifests",
                         s3.uri("nothing-here"), "--out", str(tmp_path / "r2.html"))
    assert code == 6 and s3.uri("nothing-here") in err
