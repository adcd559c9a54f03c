"""One consistent CLI (issue 12): ``--ledger`` at every level, ``--json`` objects also on errors, no
silently created ledger, tables that keep ids and dates whole. Every command is enumerated from the
click tree, so a new command without these options fails here."""

from __future__ import annotations

import json
import os

import click
import pytest
from cli_support import make_env

from dpops.cli.main import cli as root

# Commands that need a ledger -> extra arguments that get them to the point of opening it.
CREATORS = {("ledger", "init"), ("ledger", "scope", "create")}


def leaf_commands(group: click.Group = root, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    out = {}
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        path = prefix + (name,)
        if isinstance(cmd, click.Group):
            out.update(leaf_commands(cmd, path))
        else:
            out[path] = cmd
    return out


def has_param(cmd: click.Command, name: str) -> bool:
    return any(p.name == name for p in cmd.params)


@pytest.fixture
def env(tmp_path, monkeypatch, capsys):
    e = make_env(tmp_path, monkeypatch)
    # one published run: a manifest to verify, a run to report
    assert e.run(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                 "--no-gx-checks")[0] == 0
    e.manifest = next((tmp_path / "out" / "manifests").rglob("*.published.json"))
    return e


def export_file(e, tmp_path) -> str:
    """A valid export of the env's ledger: `ledger import` verifies it before it opens the target."""
    from dpops.ledger import open_ledger

    path = tmp_path / "to-import.jsonl"
    with open_ledger(e.url) as led, open(path, "w", encoding="utf-8") as fh:
        led.export(fh)
    return str(path)


def ledger_args(e, tmp_path) -> dict[tuple[str, ...], list[str]]:
    spec, key = str(e.spec), str(e.key)
    return {
        ("ledger", "init"): [],
        ("ledger", "install-cap-check"): ["--owner-role", "owner"],
        ("ledger", "checkpoint"): ["--dir", str(tmp_path / "cp"), "--signing-key", str(tmp_path / "none.pem")],
        ("ledger", "scope", "create"): ["x", "--unit", "u", "--unit-column", "user_id", "--epsilon", "1", "--delta",
                                        "1e-7", "--accountant", "basic", "--adjacency", "add_remove"],
        ("ledger", "scope", "show"): [],
        ("ledger", "cap"): ["shop", "--epsilon", "2", "--reason", "test"],
        ("ledger", "scope", "pin-time"): ["shop", "--time-column", "ts", "--reason", "test"],
        ("ledger", "status"): ["shop"],
        ("ledger", "history"): [],
        ("ledger", "verify"): [],
        ("ledger", "export"): [str(tmp_path / "export.jsonl")],
        ("ledger", "import"): [export_file(e, tmp_path)],
        ("ledger", "recover"): ["--older-than", "0"],
        ("ledger", "runs"): [],
        ("ledger", "reserve"): [spec, "--interval", "2024-01-02", "--key-file", key],
        ("plan",): [spec, "--from", "2024-01-01", "--to", "2024-01-03"],
        ("gaps",): [spec, "--from", "2024-01-01", "--to", "2024-01-03"],
        ("release", "run"): [spec, "--interval", "2024-01-02", "--key-file", key, "--no-gx-checks"],
        ("release", "restate"): [spec, "--interval", "2024-01-01", "--key-file", key, "--no-gx-checks"],
        ("release", "status"): [spec, "--interval", "2024-01-01"],
        ("release", "abandon"): [spec, "--interval", "2024-01-02", "--key-file", key, "--reason", "test"],
        ("report",): ["--scope", "shop", "--out", str(tmp_path / "r.html")],
        ("manifest", "verify"): [str(e.manifest)],
        ("audit", "scope"): [spec, "--trials", "8"],
        # tune opens the ledger only to record a read of private data (a sample under a data root)
        ("tune",): [spec, "--sample", str(e.spec.parent / "data" / "2024-01-01.parquet"),
                    "--i-understand-this-reads-private-data", "--reason", "test", "--key-file", key,
                    "--out", str(tmp_path / "tune-out")],
        ("estimate",): [spec, "--interval", "2024-01-02", "--epsilon", "0.1", "--key-file", key,
                        "--out", str(tmp_path / "estimate-out")],
    }


def test_every_ledger_command_takes_ledger_at_every_level(env, tmp_path, capsys, monkeypatch):
    table = ledger_args(env, tmp_path)
    with_option = {p for p, c in leaf_commands().items() if has_param(c, "ledger_opt")}
    assert with_option == set(table), "a command uses a ledger but is not in this test (or lost --ledger)"
    for path, args in table.items():
        cmd = list(path)
        for where in ("root", "group", "command", "env"):
            if where == "group" and path[0] != "ledger":
                continue
            target = tmp_path / f"{'-'.join(path)}-{where}.sqlite"
            url = f"sqlite:///{target}"
            monkeypatch.delenv("DPOPS_LEDGER_URL", raising=False)
            if where == "root":
                argv = ["--ledger", url, *cmd, *args]
            elif where == "group":
                argv = [cmd[0], "--ledger", url, *cmd[1:], *args]
            elif where == "command":
                argv = [*cmd, *args, "--ledger", url]
            else:
                monkeypatch.setenv("DPOPS_LEDGER_URL", url)
                argv = [*cmd, *args]
            code, out, err = env.run(capsys, *argv)
            if path in CREATORS:
                assert code == 0 and target.exists(), (path, where, err)
            else:
                # the URL was read from that position: its (missing) file is named and nothing is created
                assert code == 6 and f"no ledger database at {target}" in err, (path, where, code, err)
                assert not target.exists(), (path, where)


def test_no_url_is_a_clear_error_and_creates_nothing(env, tmp_path, capsys, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("DPOPS_LEDGER_URL", raising=False)
    for path, args in ledger_args(env, tmp_path).items():
        if path == ("manifest", "verify"):
            continue  # the ledger is optional there: without one it says the ledger was not checked
        code, _, err = env.run(capsys, *path, *args)
        assert code == 2 and "no ledger given" in err and "DPOPS_LEDGER_URL" in err, (path, code, err)
    assert os.listdir(work) == []  # in particular no dpops-ledger.sqlite
    code, out, _ = env.run(capsys, "manifest", "verify", str(env.manifest))
    assert code == 0 and "not checked" in out and "ledger" in out


def test_two_different_urls_are_a_usage_error(env, capsys):
    code, _, err = env.run(capsys, "--ledger", env.url, "ledger", "status", "shop", "--ledger", env.url + "x")
    assert code == 2 and "--ledger was given twice" in err
    code, out, _ = env.run(capsys, "--ledger", env.url, "ledger", "status", "shop", "--ledger", env.url)
    assert code == 0 and "shop" in out


# --------------------------------------------------------------------------- --json


def json_error_cases(e, tmp_path) -> dict[tuple[str, ...], tuple[list[str], int]]:
    """Per --json command: arguments that fail, and the exit code they must fail with."""
    missing = f"sqlite:///{tmp_path / 'missing.sqlite'}"
    cases = {p: ([*a, "--ledger", missing], 6) for p, a in ledger_args(e, tmp_path).items() if p not in CREATORS}
    cases[("ledger", "init")] = (["--ledger", "postgresql://postgres@127.0.0.1:1/x"], 6)
    cases[("ledger", "scope", "create")] = ([*ledger_args(e, tmp_path)[("ledger", "scope", "create")][:-2],
                                             "--adjacency", "add_remove", "--bucket", "day", "--ledger", e.url], 3)
    cases[("ledger", "keygen")] = ([str(e.key), str(tmp_path / "pub.pem")], 3)  # never overwrites a file
    cases[("spec", "check")] = ([str(tmp_path / "nope.yaml")], 3)
    cases[("spec", "synth")] = ([str(tmp_path / "nope.yaml"), "--from", "2024-01-01", "--to", "2024-01-02"], 3)
    cases[("spec", "apply-patch")] = ([str(e.spec), str(e.spec)], 3)  # a spec is not a tune patch
    # simulate opens no ledger: a sample outside every public root is refused (3) before anything is read
    cases[("simulate",)] = ([str(e.spec), "--sample", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "sim")], 3)
    cases[("account",)] = ([str(tmp_path / "nope.json"), "--delta", "1e-6"], 3)
    cases[("key", "generate")] = ([str(e.key)], 3)  # refuses to overwrite
    cases[("key", "id")] = ([str(tmp_path / "nope.key")], None)
    cases[("key", "convert")] = ([str(e.key), str(tmp_path / "converted.key")], 3)  # already a v1 file
    cases[("manifest", "show")] = (["no-such-run", "--manifests", str(tmp_path)], 6)
    cases[("audit", "mechanisms")] = (["--mechanism", "no-such-mechanism"], None)
    cases[("audit", "spec")] = ([str(tmp_path / "nope.yaml")], 3)
    cases[("release", "check-pointer")] = (["--root", str(tmp_path / "nothing"), "--release", "purchases_test",
                                            "--interval", "2024-01-01/2024-01-02", "--key-file", str(e.key)], 7)
    open_staged = tmp_path / "open-root" / "staged"
    open_staged.mkdir(parents=True, exist_ok=True)
    open_staged.chmod(0o755)
    cases[("release", "check-staged-access")] = (["--root", str(tmp_path / "open-root")], 7)
    return cases


def test_every_json_command_prints_one_object_also_on_errors(env, tmp_path, capsys):
    cases = json_error_cases(env, tmp_path)
    with_json = {p for p, c in leaf_commands().items() if has_param(c, "as_json")}
    assert with_json == set(cases), "a --json command is not in this test"
    for path, (args, want) in cases.items():
        code, out, err = env.run(capsys, *path, *args, "--json")
        assert code != 0, (path, out)
        if want is not None:
            assert code == want, (path, code, err)
        doc = json.loads(out)  # exactly one JSON document on stdout
        assert isinstance(doc, dict) and doc["ok"] is False and doc["exit_code"] == code, (path, doc)
        assert doc.get("error") or doc.get("refusal"), (path, doc)


def test_json_success_objects_and_a_refusal(env, capsys):
    u = ["--ledger", env.url]
    for argv in (["ledger", "status", "shop"], ["ledger", "cap", "shop", "--epsilon", "1.2", "--reason", "same"],
                 ["ledger", "init"], ["ledger", "verify"], ["plan", str(env.spec), "--from", "2024-01-01", "--to",
                                                             "2024-01-03"],
                 ["gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-03"], ["spec", "check", str(env.spec)],
                 ["release", "status", str(env.spec), "--interval", "2024-01-01"]):
        code, doc, err = env.json(capsys, *u, *argv, "--json")  # root-level --ledger: ignored where unused
        assert code == 0 and doc["ok"] is True and doc["exit_code"] == 0, (argv, err)
    # cap 1.2, 0.5 per run: the second day fits, the third is refused (exit 5) with a JSON refusal
    code, doc, _ = env.json(capsys, "release", "run", str(env.spec), *env.base("2024-01-02"), *u, "--publish",
                            "--no-gx-checks", "--json")
    assert code == 0 and doc["state"] == "published"
    code, doc, err = env.json(capsys, "release", "run", str(env.spec), *env.base("2024-01-03"), *u, "--publish",
                              "--no-gx-checks", "--json")
    assert code == 5 and doc["ok"] is False and doc["exit_code"] == 5 and "budget refused" in doc["refusal"]
    assert doc["state"] == "refused" and doc["release"] == "purchases_test" and "2024-01-03" in doc["interval"]
    assert "charged ε=0 this run (it would have cost ε=0.5)" in doc["budget"]
    assert "budget refused" in err  # the human line still goes to stderr


# --------------------------------------------------------------------------- tables


@pytest.mark.parametrize("columns", [80, 200])
def test_tables_keep_full_run_ids_and_dates(env, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert env.run(capsys, "release", "run", str(env.spec), *env.base("2024-01-02"), "--ledger", env.url,
                   "--no-gx-checks")[0] == 0  # a staged (started) run too
    from dpops.ledger import open_ledger

    with open_ledger(env.url) as led:
        recs = led.runs()
    assert len(recs) == 2
    code, out, _ = env.run(capsys, "ledger", "runs", "--ledger", env.url)
    assert code == 0
    for r in recs:
        assert r.run_id in out and r.key.interval_start in out and r.key.interval_end in out, out
    assert all(len(line) <= columns or len(line.split()) <= 2 for line in out.splitlines())  # a long URI: whole
    code, out, _ = env.run(capsys, "ledger", "history", "--ledger", env.url)
    assert code == 0 and all(r.run_id in out for r in recs)
    assert all(len(line) <= columns or len(line.split()) <= 2 for line in out.splitlines())  # a long URI: whole
    code, out, _ = env.run(capsys, "gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-05", "--all",
                           "--ledger", env.url)
    assert code == 0 and all(f"2024-01-0{d}T00:00:00Z" in out for d in range(1, 6))
    assert all(len(line) <= columns or len(line.split()) <= 2 for line in out.splitlines())  # a long URI: whole
