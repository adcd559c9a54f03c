"""Can a reader reach ``staged/``? The check behind ``dpops release check-staged-access`` (issue 19 item 8).

``staged/`` holds noisy values that are not released yet (two staged attempts, or a staged output that
is then refused, tell a reader more than the release promises) and, until a run's retry or publish
sweeps it, a killed attempt's scratch shards. Readers of the product must not list or read it:

- local roots: every level of ``staged/`` is 0700 (``dpops.storage.local``); the check fails when any
  directory of the tree gives group or others any permission bit.
- object stores have no modes: a bucket policy must deny ``s3:ListBucket`` on the ``staged/`` prefix
  and ``s3:GetObject`` on ``staged/*`` to every principal but the dpops identity
  (``deploy/s3-bucket-policy.json``). dpops cannot read a policy on a reader's behalf, so the check
  runs **with the reader's credentials** (the standard provider chain, e.g. ``AWS_PROFILE=reader``) and
  tries what a reader would: list ``staged/`` and read one object there. Anything that succeeds is
  reported.
"""

from __future__ import annotations

import os
import stat

from dpops.storage.location import Location


def check_staged_access(root: Location) -> list[str]:
    """Problems (empty: ``staged/`` is closed to whoever runs this) for the output ``root``."""
    staged = root / "staged"
    if root.is_local:
        return _local(staged)
    if root.scheme != "s3":
        return [f"{staged}: dpops can probe only s3:// and local roots; check the {root.scheme}:// bucket's "
                "policy denies readers the staged/ prefix by hand"]
    return _s3(staged)


def _local(staged: Location) -> list[str]:
    base = staged.local_path
    if not base.exists():
        return []
    out = []
    for dirpath, dirnames, _ in os.walk(base):
        mode = stat.S_IMODE(os.lstat(dirpath).st_mode)
        if mode & 0o077:
            out.append(f"{dirpath} is mode {mode:o}: group or others can reach staged output (must be 0700; "
                       "the next run tightens it, or chmod -R go-rwx it now)")
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return out


def _s3(staged: Location) -> list[str]:
    from botocore.exceptions import ClientError

    from dpops.storage.objectstore import s3_client

    bucket, _, key = staged.path.partition("/")
    prefix = key.rstrip("/") + "/"
    client = s3_client()
    try:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=5)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code in ("AccessDenied", "403", "Forbidden"):
            return []
        return [f"{staged}: listing failed with {code}, not AccessDenied: cannot tell whether readers are denied"]
    keys = [o["Key"] for o in listing.get("Contents", []) if not o["Key"].endswith("/")]
    out = [f"{staged}: these credentials may list staged/ ({len(keys)} object(s) seen): the bucket policy must "
           "deny readers s3:ListBucket on the staged/ prefix (deploy/s3-bucket-policy.json)"]
    if keys:
        try:
            client.get_object(Bucket=bucket, Key=keys[0])["Body"].close()
            out.append(f"{staged}: these credentials may read staged objects (read s3://{bucket}/{keys[0]}): the "
                       "bucket policy must deny readers s3:GetObject on staged/*")
        except ClientError:
            pass
    return out


__all__ = ["check_staged_access"]
