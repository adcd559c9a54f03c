"""The privacy budget inside the Airflow UI (issue 21 item 17): a nav page and a tab on each DAG run.

A FastAPI app mounted by the api-server under ``/dpops-budget`` and two ``external_views``. The pages
are built by ``dpops.budget_view`` (Airflow-free); this file only authenticates, looks up the DAG
run's data interval and serves HTML or a manifest file.

Authentication: a mounted sub-app inherits none of the core API's dependencies (docs/decisions.md,
"The privacy budget in the Airflow UI"), so the app itself depends on ``GetUserDep``-style ``get_user`` for every
route, and each route also asks the auth manager for read access to DAGs (the run tab: to that
DAG's runs). An anonymous request gets 401, a bad token 403, a user without DAG access 403.

What it reads: the ledger at ``DPOPS_LEDGER_URL``, which deploy/ points at the read-only reader role
(``dpops_reader``: SELECT only, PostgreSQL refuses its writes; the page warns when its role may write),
``DPOPS_MANIFESTS_DIR`` and the published pointers on a read-only mount of the outputs, and the release
specs in ``DPOPS_SPECS_DIR`` (for ``dpops gaps``' reasons). Never the noise key, the private run log or
/data/input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse

from dpops.errors import DpopsError, InvalidParameter

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


@app.get("/", response_class=HTMLResponse, dependencies=[Depends(requires_access_dag("GET"))])
def budget_page() -> HTMLResponse:
    """The nav page: every scope, spend over time, refusals and gaps, manifests."""
    from dpops.budget_view import budget_page as build
    from dpops.budget_view import render_page

    with _open_ledger() as ledger:
        page = build(ledger, _manifests_dir(), _specs())
    return HTMLResponse(render_page(page, manifest_href="manifests/"))


@app.get("/manifests/{run_id}", dependencies=[Depends(requires_access_dag("GET"))])
def manifest(run_id: Annotated[str, PathParam(pattern=RUN_ID_PATTERN)]) -> FileResponse:
    """One manifest file, by run id (32 hex digits; dpops.budget_view.manifest_file checks it again)."""
    from dpops.budget_view import manifest_file

    try:
        path = manifest_file(_manifests_dir(), run_id)
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
    start = dr.data_interval_start.isoformat() if dr.data_interval_start else None
    end = dr.data_interval_end.isoformat() if dr.data_interval_end else None
    with _open_ledger() as ledger:
        view = run_view(ledger, _manifests_dir(), dag_id, start, end)
    # The tab lives at /dpops-budget/runs/<dag>/<run>: the download route is two levels up.
    return HTMLResponse(render_run(view, manifest_href="../../manifests/"))


class DpopsBudgetPlugin(AirflowPlugin):
    """The app under /dpops-budget, a nav entry and a tab on every DAG run."""

    name = "dpops_budget"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "dpops privacy budget"}]
    external_views = [
        {"name": "Privacy budget", "href": f"{URL_PREFIX}/", "destination": "nav", "url_route": "privacy-budget"},
        {"name": "Privacy budget", "href": f"{URL_PREFIX}/runs/{{DAG_ID}}/{{RUN_ID}}", "destination": "dag_run",
         "url_route": "privacy-budget-run"},
    ]
