#!/bin/sh
# The compose `airflow-init` service: migrate Airflow's metadata database (this also creates the
# FAB auth manager's tables), then create or re-key the admin user from the mounted secret
# (deploy/create_admin.py: the password never appears on a command line).
set -eu
airflow db migrate
exec python "$(dirname "$0")/create_admin.py"
