"""The privacy budget inside the Airflow UI (issue 21 item 17): a nav page and a tab on each DAG run.

A FastAPI app mounted by the api-server under ``/dpops-budget`` and two ``external_views``. The pages
are built by ``dpops.budget_view`` (Airflow-free); this file only authenticates, looks up the DAG
run's data interval and serves HTML or a manifest file.

Authentication: a mounted sub-app inherits none of the core API's dependencies (docs/decisions.md,
"The privacy budget in the Airflow UI"), so the app itself depends on ``GetUserDep``-style ``get_user`` for every
route, and each route also asks the auth manager for read access to DAGs (the run tab: to that
DAG's runs). An anonymous request gets 401, a bad token 403, a user without DAG access 403.

Per-DAG access (issue 25 item 11): a user may be allowed some DAGs only. The page and the manifest
download ask the auth manager which of the DAGs concerned the user may read (``_readable``) and pass that
to ``dpops.budget_view``, which shows only those releases' manifests, refusals and gaps, shows a scope's
figures only to a user who may read every release DAG drawing from it (they compose all of them), and
answers a manifest of an unreadable DAG with 404, like a missing one. The run tab's route names its DAG
(``dag_id`` in the path), which ``requires_access_dag`` checks.

What it reads: the ledger at ``DPOPS_LEDGER_URL``, which deploy/ points at the read-only reader role
(``dpops_reader``: SELECT only, PostgreSQL refuses its writes; the page warns when its role may write),
``DPOPS_MANIFESTS_DIR`` and the published pointers on a read-only mount of the outputs, and the release
specs in ``DPOPS_SPECS_DIR`` (for ``dpops gaps``' reasons). Never the noise key, the private run log or
/data/input.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, get_user, requires_access_dag
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse
from sqlalchemy.orm import Session

from dpops.errors import DpopsError, InvalidParameter

if TYPE_CHECKING:
    from dpops.budget_view import DagRunOutcome

URL_PREFIX = "/dpops-budget"
RUN_ID_PATTERN = r"^[0-9a-f]{32}$"

# Every route: an authenticated user first (401 anonymous), whatever the route adds.
app = FastAPI(title="dpops privacy budget", dependencies=[Depends(get_user)], docs_url=None, redoc_url=None,
              openapi_url=None)


def _specs() -> list[str]:
    folder = os.environ.get("DPOPS_SPECS_DIR")
    if not folder or not Path(folder).is_dir():
        return []
    return sorted(str(p) for p in Path(folder).iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def _manifests_dir() -> str | None:
    return os.environ.get("DPOPS_MANIFESTS_DIR") or None


def _open_ledger():  # noqa: ANN202 - dpops.ledger.Ledger
    from dpops.ledger import open_ledger

    url = os.environ.get("DPOPS_LEDGER_URL")
    if not url:
        raise HTTPException(503, "the api-server has no DPOPS_LEDGER_URL (the read-only ledger role's URL): see "
                                 "deploy/README.md 'The privacy budget in the Airflow UI'")
    try:
        return open_ledger(url)
    except DpopsError as exc:  # the message may name the host: only the class is shown
        raise HTTPException(503, f"the ledger cannot be opened ({type(exc).__name__})") from None


def _readable(user: object) -> Callable[[set[str]], set[str]]:
    """Of the given DAG ids, those ``user`` may read, as the api-server's auth manager decides (per DAG: a
    FAB role may grant ``can_read`` on ``DAG:<dag_id>`` alone)."""
    from airflow.api_fastapi.app import get_auth_manager

    manager = get_auth_manager()

    def readable(dag_ids: set[str]) -> set[str]:
        if not dag_ids:
            return set()
        return set(manager.filter_authorized_dag_ids(dag_ids=set(dag_ids), user=user, method="GET"))

    return readable


@app.get("/", response_class=HTMLResponse, dependencies=[Depends(requires_access_dag("GET"))])
def budget_page(user: GetUserDep) -> HTMLResponse:
    """The nav page: the scopes, spend over time, refusals and gaps and manifests the user may read."""
    from dpops.budget_view import budget_page as build
    from dpops.budget_view import render_page

    with _open_ledger() as ledger:
        page = build(ledger, _manifests_dir(), _specs(), readable=_readable(user))
    return HTMLResponse(render_page(page, manifest_href="manifests/"))


@app.get("/manifests/{run_id}", dependencies=[Depends(requires_access_dag("GET"))])
def manifest(run_id: Annotated[str, PathParam(pattern=RUN_ID_PATTERN)], user: GetUserDep) -> FileResponse:
    """One manifest file, by run id (32 hex digits; dpops.budget_view.manifest_file checks it again), of a
    release whose DAG the user may read."""
    from dpops.budget_view import manifest_file

    try:
        path = manifest_file(_manifests_dir(), run_id, readable=_readable(user))
    except InvalidParameter:
        raise HTTPException(422, "a run id is 32 lowercase hex digits") from None
    except DpopsError:
        raise HTTPException(404, "no manifest for this run") from None
    return FileResponse(path, media_type="application/json", filename=path.name)


@app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse,
         dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.RUN))])
def run_tab(dag_id: str, run_id: str, session: SessionDep) -> HTMLResponse:
    """A DAG run's tab: the ledger run of its data interval, its manifest and that manifest's verification."""
    from airflow.models.dagrun import DagRun
    from sqlalchemy import select

    from dpops.budget_view import render_run, run_view

    dr = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if dr is None:
        raise HTTPException(404, "no such DAG run")
    start, end, note = _run_interval(dag_id, dr)
    with _open_ledger() as ledger:
        view = run_view(ledger, _manifests_dir(), dag_id, start, end, outcome=_outcome(session, dag_id, run_id),
                        note=note)
    # The tab lives at /dpops-budget/runs/<dag>/<run>: the download route is two levels up.
    return HTMLResponse(render_run(view, manifest_href="../../manifests/"))


def _run_interval(dag_id: str, dr: object) -> tuple[str | None, str | None, str]:
    """The interval the DAG run releases, by the DAG's own rule (``dpops.run_interval``): a run triggered the
    documented way (REST ``logical_date: null``, ``conf.interval``) has no data interval (issue 28 item 2).
    Returns (start, end, why not) with the reason when none can be resolved."""
    from dpops.dag_ids import release_of_dag
    from dpops.errors import public_message
    from dpops.run_interval import resolve_run_interval
    from dpops.spec import load_spec

    release = release_of_dag(dag_id)
    spec_path = None
    for path in _specs():
        try:
            if load_spec(path).name == release:
                spec_path = path
                break
        except DpopsError:
            continue
    conf = getattr(dr, "conf", None) or {}
    try:
        start, end = resolve_run_interval(spec_path, data_interval_start=getattr(dr, "data_interval_start", None),
                                          data_interval_end=getattr(dr, "data_interval_end", None),
                                          logical_date=getattr(dr, "logical_date", None),
                                          named=conf.get("interval") if isinstance(conf, dict) else None,
                                          dag_id=dag_id)
    except DpopsError as exc:
        return None, None, f"this DAG run releases no interval: {public_message(exc)}"
    return start, end, ""


def _outcome(session: Session, dag_id: str, run_id: str) -> DagRunOutcome | None:
    """What this DAG run's reserve task decided (its XCom ``dpops_outcome``), or None before it ran."""
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    from dpops.budget_view import DagRunOutcome

    row = session.scalar(select(XComModel).where(
        XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == "reserve_budget",
        XComModel.key == "dpops_outcome"))
    if row is None:
        return None
    value = XComModel.deserialize_value(row)
    if not isinstance(value, dict) or not isinstance(value.get("run_id"), str):
        return None
    return DagRunOutcome(run_id=value["run_id"], state=str(value.get("state") or ""))


class DpopsBudgetPlugin(AirflowPlugin):
    """The app under /dpops-budget, a nav entry and a tab on every DAG run."""

    name = "dpops_budget"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "dpops privacy budget"}]
    external_views = [
        {"name": "Privacy budget", "href": f"{URL_PREFIX}/", "destination": "nav", "url_route": "privacy-budget"},
        {"name": "Privacy budget", "href": f"{URL_PREFIX}/runs/{{DAG_ID}}/{{RUN_ID}}", "destination": "dag_run",
         "url_route": "privacy-budget-run"},
    ]
