#!/usr/bin/env python
"""A minimal Beam SDK-container ``boot`` for the test worker pools (``worker_pool_main --container_executable``).

Why: ``worker_pool_main`` without a container executable starts each SDK worker as
``python -c "SdkHarness(...).run()"``, which never receives the job's pipeline options, so
``FileSystems`` in a worker has none and Beam's S3 filesystem fails ("Must provide one of client or
options"). Real cluster workers (Flink/Spark task managers, Dataflow VMs, Kubernetes pods) run the
SDK container's ``boot``, which fetches the options from the provision service and starts
``sdk_worker_main`` (which calls ``FileSystems.set_options``). This script does the same, minus the
artifact staging: the code (this checkout, the venv) is on the worker already, as in a worker image.

Contract (Beam's container spec): called with --id, --logging_endpoint, --artifact_endpoint,
--provision_endpoint, --control_endpoint; execs ``python -m apache_beam.runners.worker.sdk_worker_main``
with PIPELINE_OPTIONS, LOGGING/CONTROL(/STATUS)_API_SERVICE_DESCRIPTOR, WORKER_ID, RUNNER_CAPABILITIES
and SEMI_PERSISTENT_DIRECTORY in its environment.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    for name in ("id", "logging_endpoint", "artifact_endpoint", "provision_endpoint", "control_endpoint"):
        parser.add_argument(f"--{name}", required=name in ("id", "provision_endpoint", "control_endpoint"))
    args, _ = parser.parse_known_args(argv)

    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc, endpoints_pb2
    from google.protobuf import json_format, text_format

    channel = grpc.insecure_channel(args.provision_endpoint)
    stub = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel)
    metadata = [("worker_id", args.id)]
    info = stub.GetProvisionInfo(beam_provision_api_pb2.GetProvisionInfoRequest(), metadata=metadata).info
    channel.close()

    def descriptor(url: str) -> str:
        return text_format.MessageToString(endpoints_pb2.ApiServiceDescriptor(url=url))

    env = dict(os.environ)
    env["PIPELINE_OPTIONS"] = json_format.MessageToJson(info.pipeline_options)
    env["WORKER_ID"] = args.id
    env["CONTROL_API_SERVICE_DESCRIPTOR"] = descriptor(info.control_endpoint.url or args.control_endpoint)
    logging_url = info.logging_endpoint.url or args.logging_endpoint
    if logging_url:
        env["LOGGING_API_SERVICE_DESCRIPTOR"] = descriptor(logging_url)
    if info.status_endpoint.url:
        env["STATUS_API_SERVICE_DESCRIPTOR"] = descriptor(info.status_endpoint.url)
    env["RUNNER_CAPABILITIES"] = " ".join(info.runner_capabilities)
    env["SEMI_PERSISTENT_DIRECTORY"] = tempfile.mkdtemp(prefix="beam-sdk-")
    os.execve(sys.executable, [sys.executable, "-m", "apache_beam.runners.worker.sdk_worker_main"], env)


if __name__ == "__main__":
    main()
