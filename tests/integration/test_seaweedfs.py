"""The local S3 (SeaweedFS): room for many buckets, and nothing left in /tmp after it stops."""

from __future__ import annotations

import glob

import pytest

from infra.services import ACCESS_KEY, SECRET_KEY, s3_client, start_seaweedfs, stop

pytestmark = pytest.mark.integration


def test_many_buckets_take_writes_and_stop_leaves_no_sockets(tmp_path):
    before = set(glob.glob("/tmp/seaweedfs-*")) | set(glob.glob("/tmp/weed.*"))
    service = start_seaweedfs(tmp_path / "s3", "bucket-0", ACCESS_KEY, SECRET_KEY)
    try:
        client = s3_client(service.url, ACCESS_KEY, SECRET_KEY)
        for i in range(6):  # a fixed -volume.max=16 said "No writable volumes" at the third
            if i:
                client.create_bucket(Bucket=f"bucket-{i}")
            client.put_object(Bucket=f"bucket-{i}", Key="k", Body=b"x" * 4096)
            assert client.get_object(Bucket=f"bucket-{i}", Key="k")["Body"].read() == b"x" * 4096
    finally:
        stop(service)
    after = set(glob.glob("/tmp/seaweedfs-*")) | set(glob.glob("/tmp/weed.*"))
    ours = [p for p in after - before if any(str(port + 10000) in p or str(port) in p
                                             for port in service.extra["ports"].values())]
    assert ours == [] and not glob.glob(service.extra["tmpdir"])
