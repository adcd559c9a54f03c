"""Public files come only from the operator's public roots, and their rows reach the manifest only when the
operator marked the root publishable (issue 19 item 6), through the real CLI (`spec check`, `release run`,
`manifest verify`)."""

from __future__ import annotations

import json

import pytest
import yaml

from dpops.cli.main import main as dpops_main
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey

PATIENTS = "patient_id,diagnosis,zip\np-0001,HIV,02139\np-0002,diabetes,94110\n"


def _doc(name: str, public_file: str, columns: dict[str, str], partition_columns: list[str]) -> dict:
    return {
        "name": name,
        "input": {"path": "{start:%Y-%m-%d}.csv", "format": "csv", "columns": columns},
        "privacy_unit": {"column": "user_id", "description": "a user's rows on one day", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
        "partitions": {"columns": partition_columns, "public_file": public_file},
        "metrics": [{"type": "count"}],
        "output": {"root": "out"},
    }


@pytest.fixture
def site(tmp_path, monkeypatch):
    """data/ (the data roots: this release's input and another release's private input), public/ (the
    operator's public root), specs/, a key, a ledger with a scope."""
    for var in ("DPOPS_PUBLIC_ROOTS", "DPOPS_PUBLIC_ROOTS_PUBLISHABLE", "DPOPS_NOISE_KEY_FILE", "DPOPS_NOISE_KEY_ID",
                "DPOPS_OUTPUT_ROOTS", "DPOPS_MANIFESTS_DIR"):
        monkeypatch.delenv(var, raising=False)
    data, public, specs = tmp_path / "data", tmp_path / "public", tmp_path / "specs"
    for d in (data / "shop", data / "clinic", public, specs):
        d.mkdir(parents=True)
    (data / "clinic" / "2024-01-01.csv").write_text(PATIENTS)  # another release's private input
    (data / "shop" / "2024-01-01.csv").write_text(
        "user_id,region\n" + "".join(f"u{i},{'north' if i % 2 else 'south'}\n" for i in range(60)))
    (public / "regions.csv").write_text("region\nnorth\nsouth\n")
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(data))
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "secret").mkdir(mode=0o700)
    key = tmp_path / "secret" / "noise.key"
    NoiseKey.generate(key)
    url = f"sqlite:///{tmp_path / 'secret' / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's rows on one day", unit_column="user_id",
                                         epsilon=10.0, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
    return {"tmp": tmp_path, "data": data, "public": public, "specs": specs, "key": key, "url": url}


def _spec(site, name: str, public_file: str, *, stealing: bool = False):
    if stealing:  # the other release's columns, declared so that its header is "the partition columns"
        doc = _doc(name, public_file, {"user_id": "string", "patient_id": "string", "diagnosis": "string",
                                       "zip": "string"}, ["patient_id", "diagnosis", "zip"])
    else:
        doc = _doc(name, public_file, {"user_id": "string", "region": "string"}, ["region"])
    doc["input"]["path"] = str(site["data"] / "shop" / "{start:%Y-%m-%d}.csv")
    path = site["specs"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _release(site, spec, capsys, interval="2024-01-01/2024-01-02"):
    code = dpops_main(["release", "run", str(spec), "--interval", interval, "--ledger", site["url"],
                       "--key-file", str(site["key"]), "--publish", "--no-gx-checks"])
    return code, capsys.readouterr()


def _charged(site) -> float:
    with open_ledger(site["url"]) as led:
        return led.status("shop").total


def test_another_releases_input_as_public_file_is_refused_by_spec_check_and_run(site, monkeypatch, capsys):
    """The exploit of issue 19 item 6: `public_file` at another release's input CSV passed `spec check` and
    published every row as partition labels. Now it is refused (exit 3) before anything is reserved, with
    or without public roots, also through a symlink from the public root into the data."""
    victim = str(site["data"] / "clinic" / "2024-01-01.csv")
    spec = _spec(site, "steal", victim, stealing=True)
    assert dpops_main(["spec", "check", str(spec)]) == 3
    err = capsys.readouterr().err
    assert "DPOPS_PUBLIC_ROOTS" in err and "p-0001" not in err and "HIV" not in err
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["public"]))
    assert dpops_main(["spec", "check", str(spec)]) == 3
    err = capsys.readouterr().err
    assert "resolves under the data root" in err and "HIV" not in err
    code, res = _release(site, spec, capsys)
    assert code == 3 and "resolves under the data root" in res.err and "HIV" not in res.out + res.err
    (site["public"] / "clinic.csv").symlink_to(victim)  # a link planted in the public root
    spec = _spec(site, "steal", str(site["public"] / "clinic.csv"), stealing=True)
    assert dpops_main(["spec", "check", str(spec)]) == 3
    assert "resolves under the data root" in capsys.readouterr().err
    assert _charged(site) == 0
    with open_ledger(site["url"]) as led:
        assert led.runs() == []
    assert not (site["specs"] / "out").exists()


@pytest.mark.parametrize("overlap", ["parent", "same", "inside"])
def test_a_public_root_overlapping_a_data_root_is_refused(site, monkeypatch, capsys, overlap):
    root = {"parent": site["tmp"], "same": site["data"], "inside": site["data"] / "clinic"}[overlap]
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", f"{site['public']},{root}")
    spec = _spec(site, "shop_daily", str(site["public"] / "regions.csv"))
    assert dpops_main(["spec", "check", str(spec)]) == 3
    assert "overlaps the data root" in capsys.readouterr().err
    # with DPOPS_DATA_ROOTS unset the data root is the spec's directory: a public root containing it is refused
    monkeypatch.delenv("DPOPS_DATA_ROOTS")
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["tmp"]))
    assert dpops_main(["spec", "check", str(spec)]) == 3
    assert "overlaps the data root" in capsys.readouterr().err


def test_publishable_marks_must_lie_in_public_roots(site, monkeypatch, capsys):
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["public"]))
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS_PUBLISHABLE", str(site["tmp"] / "elsewhere"))
    spec = _spec(site, "shop_daily", str(site["public"] / "regions.csv"))
    assert dpops_main(["spec", "check", str(spec)]) == 3
    assert "DPOPS_PUBLIC_ROOTS_PUBLISHABLE" in capsys.readouterr().err


def _manifest(site, release: str) -> tuple[dict, str]:
    path = next((site["specs"] / "out" / "manifests").rglob(f"*{release}*.published.json"), None) \
        or next(p for p in (site["specs"] / "out" / "manifests").rglob("*.published.json")
                if json.loads(p.read_text())["run_key"]["release"] == release)
    return json.loads(path.read_text()), str(path)


def test_a_public_file_reaches_the_manifest_as_a_count_unless_publishable(site, monkeypatch, capsys):
    """From a public root the release runs; the manifest carries the file's row count, not its rows, and
    `manifest verify` recomputes the claim from it. From a root the operator marked publishable, the rows
    are in the manifest as before. A changed list changes the run's keyed input fingerprint."""
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["public"]))
    (site["public"] / "regions.csv").write_text("region\nnorth\nsouth\nzz-secret-label\n")
    spec = _spec(site, "shop_daily", str(site["public"] / "regions.csv"))
    code, res = _release(site, spec, capsys)
    assert code == 0, res.err
    m, path = _manifest(site, "shop_daily")
    parts = m["spec"]["partitions"]
    assert parts["public_file_count"] == 3 and "public_file_content" not in parts
    assert m["partitions"]["public_count"] == 3 and m["partitions"]["strategy"] == "public_file"
    assert "zz-secret-label" not in json.dumps(m)
    assert dpops_main(["manifest", "verify", path]) == 0, capsys.readouterr()
    capsys.readouterr()

    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS_PUBLISHABLE", str(site["public"]))
    spec2 = _spec(site, "shop_daily_pub", str(site["public"] / "regions.csv"))
    code, res = _release(site, spec2, capsys)
    assert code == 0, res.err
    m2, path2 = _manifest(site, "shop_daily_pub")
    assert m2["spec"]["partitions"]["public_file_content"] == [["north"], ["south"], ["zz-secret-label"]]
    assert dpops_main(["manifest", "verify", path2]) == 0, capsys.readouterr()


def test_the_public_rows_enter_the_keyed_input_fingerprint(site, monkeypatch):
    from dpops.inputs import input_fingerprint, public_file_rows
    from dpops.spec import load_spec

    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["public"]))
    spec_path = _spec(site, "shop_daily", str(site["public"] / "regions.csv"))
    key = NoiseKey.from_file(site["key"])
    files = [str(site["data"] / "shop" / "2024-01-01.csv")]
    a = load_spec(spec_path)
    (site["public"] / "regions.csv").write_text("region\nnorth\neast\n")  # same count, other labels
    b = load_spec(spec_path)
    assert a.spec_hash == b.spec_hash  # the count is all the spec document holds of a non-publishable file
    assert input_fingerprint(files, key, public_file_rows(a)) != input_fingerprint(files, key, public_file_rows(b))
    assert input_fingerprint(files, key, public_file_rows(a)) != input_fingerprint(files, key)


def test_a_public_list_changed_while_the_pipeline_runs_is_never_published(site, monkeypatch):
    """The spec hash holds only the row count of an unmarked public file, so a same-size list swapped while
    the pipeline runs is caught by the keyed input fingerprint, re-read from the file: never published."""
    from dpops import release
    from dpops.errors import InputDataError

    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["public"]))
    spec = _spec(site, "shop_daily", str(site["public"] / "regions.csv"))

    def swapping_pipeline(req):
        from pipelines.release_pipeline import run_release

        out = run_release(req)
        (site["public"] / "regions.csv").write_text("region\nnorth\neast\n")  # same count, another label
        return out

    with open_ledger(site["url"]) as led:
        with pytest.raises(InputDataError, match="input files changed since the run was prepared .*while the pipeline"):
            release.execute_release(spec, "2024-01-01", "2024-01-02", ledger=led, key_path=str(site["key"]),
                                    run_release=swapping_pipeline)
        (rec,) = led.runs()
        assert rec.state == "started"  # noise was drawn: charged, never published
    assert not any((site["specs"] / "out").rglob("published/**/data.parquet"))


PUBLIC_CLINIC_LIKE = "patient_id,diagnosis,zip\npub-1,none,00000\n"


def _flip_site(site, monkeypatch):
    """public/list.csv: a symlink to an approved public file with the victim's header, a spec naming it."""
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(site["public"]))
    (site["public"] / "approved.csv").write_text(PUBLIC_CLINIC_LIKE)
    link = site["public"] / "list.csv"
    link.symlink_to(site["public"] / "approved.csv")
    return link, _spec(site, "flip", str(link), stealing=True)


def _flip(link, target) -> None:
    tmp = link.with_name(".list.tmp")
    tmp.symlink_to(target)
    tmp.replace(link)  # atomic, as an attacker with write access to the public root would do it


def test_a_symlink_flipped_right_after_the_check_never_loads_private_rows(site, monkeypatch):
    """Issue 25 item 11: ``public_file`` was checked (realpath under a public root), then opened again by name;
    flipping the link in between loaded another release's private rows as partition labels. Here the flip
    happens exactly in that window (right after ``check_public_path`` returns), so the test is deterministic:
    the rows loaded are the approved file's, read from the descriptor that was checked."""
    import dpops.dataroots as dataroots
    from dpops.errors import SpecError
    from dpops.spec import load_spec

    link, spec = _flip_site(site, monkeypatch)
    victim = site["data"] / "clinic" / "2024-01-01.csv"
    real_check = dataroots.check_public_path

    def check_then_flip(*args, **kwargs):
        out = real_check(*args, **kwargs)
        _flip(link, victim)  # the attacker wins the race: after the check, before any re-open by name
        return out

    monkeypatch.setattr(dataroots, "check_public_path", check_then_flip)
    try:
        rows = load_spec(spec).public_partitions()
    except SpecError as exc:  # refusing is fine too; loading the victim's rows is not
        assert "HIV" not in str(exc) and "p-0001" not in str(exc)
    else:
        assert rows == [("pub-1", "none", "00000")], rows


def test_a_symlink_flipping_during_loads_never_yields_private_rows(site, monkeypatch):
    """The race itself, bounded: a thread flips the link between the approved file and the victim while the
    spec is loaded 600 times. Every load yields the approved rows or a refusal (exit-3 SpecError), never the
    victim's rows (the issue saw 28-54 private loads in 4,000 before the fix). Not statistical: the property is
    "zero private loads", so it cannot fail by chance; a regression is caught with high probability, not
    certainty (the deterministic test above always catches it)."""
    import threading

    from dpops.errors import SpecError
    from dpops.spec import load_spec

    link, spec = _flip_site(site, monkeypatch)
    victim = site["data"] / "clinic" / "2024-01-01.csv"
    stop = threading.Event()

    def flipper() -> None:
        targets = (victim, site["public"] / "approved.csv")
        i = 0
        while not stop.is_set():
            _flip(link, targets[i % 2])
            i += 1

    t = threading.Thread(target=flipper, daemon=True)
    t.start()
    private = public = refused = 0
    try:
        for _ in range(600):
            try:
                rows = load_spec(spec).public_partitions()
            except SpecError as exc:
                assert "HIV" not in str(exc)
                refused += 1
                continue
            if any(r[0].startswith("p-") for r in rows):
                private += 1
            else:
                public += 1
    finally:
        stop.set()
        t.join(5)
    assert private == 0, (private, public, refused)
    assert public + refused == 600
