# The ledger database: PostgreSQL with PL/Python and dpops, so that the database itself refuses a reservation
# over the cap (`dpops ledger install-cap-check`, run by deploy/ledger-db-init.sh on first start).
#
# Build from the repository root:  docker build -f deploy/ledger-db.Dockerfile -t dpops-ledger-db .
# The server's Python (Debian bookworm's 3.11) imports dpops from /opt/dpops-ledger, a virtualenv built with that
# same Python, owned by root and only readable by the server's user: whoever can write those files decides what
# the cap check runs, so nothing but this image's build writes them.
FROM postgres:16-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-plpython3-16 python3-venv \
 && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md /src/
COPY deploy/constraints-py3.11.txt /src/deploy/
COPY dpops /src/dpops
RUN python3 -m venv /opt/dpops-ledger \
 && /opt/dpops-ledger/bin/pip install --no-cache-dir -c /src/deploy/constraints-py3.11.txt '/src[postgres]' \
 && rm -rf /src \
 && chmod -R go-w /opt/dpops-ledger
