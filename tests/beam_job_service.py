"""Beam's local job service, honouring ``--sdk_worker_parallelism`` as Flink and Spark do.

The Python local job service (``local_job_service_main``) runs every job with ONE SDK worker per
environment: it builds ``FnApiRunner(provision_info=...)`` (whose worker count is fixed at 1) and calls
``run_via_runner_api``, which never reads the options. A cluster runner starts
``sdk_worker_parallelism`` SDK workers per node and spreads bundles over them. To test "the same
result with two SDK workers", this launcher gives the runner that worker count (the runner then asks
the EXTERNAL pool for that many workers and partitions each stage's input over them) and otherwise is
``local_job_service_main`` unchanged. Test-only: it sets a private attribute of Beam's FnApiRunner
(checked by ``tests/test_cluster_harness.py``, which counts the workers the pool started).
"""

from __future__ import annotations

import sys

from apache_beam.options.pipeline_options import PortableOptions
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.runners.portability import local_job_service, local_job_service_main
from apache_beam.runners.portability.fn_api_runner import fn_runner


def _invoke_runner(self):  # replaces local_job_service.BeamJob._invoke_runner
    self.set_state(beam_job_api_pb2.JobState.RUNNING)
    runner = fn_runner.FnApiRunner(provision_info=self._provision_info)
    wanted = self.pipeline_options().view_as(PortableOptions).sdk_worker_parallelism
    runner._num_workers = max(1, int(wanted or 1))
    return runner.run_via_runner_api(self._pipeline_proto, self.pipeline_options())


if __name__ == "__main__":
    local_job_service.BeamJob._invoke_runner = _invoke_runner
    local_job_service_main.run(sys.argv[1:])
