"""The local S3 (SeaweedFS): room for many buckets, and nothing left in /tmp after it stops."""

from __future__ import annotations

import glob

import pytest

from grpo_pipeline.infra.services import ACCESS_KEY, SECRET_KEY, s3_client, start_seaweedfs, stop

pytestmark = pytest.mark.integration


def test_many_buckets_take_writes(s3_endpoint):
    client = s3_client(s3_endpoint, ACCESS_KEY, SECRET_KEY)
    for i in range(6):  # with a fixed -volume.max=16, the third bucket's first write found "No writable volumes"
        client.create_bucket(Bucket=f"many-{i}")
        client.put_object(Bucket=f"many-{i}", Key="k", Body=b"x" * 4096)
        assert client.get_object(Bucket=f"many-{i}", Key="k")["Body"].read() == b"x" * 4096


def test_a_stopped_server_leaves_nothing_in_tmp(tmp_path):
    before = set(glob.glob("/tmp/seaweedfs-*")) | set(glob.glob("/tmp/weed.*"))
    service = start_seaweedfs(tmp_path / "s3", "bucket-0", ACCESS_KEY, SECRET_KEY)
    try:
        s3_client(service.url, ACCESS_KEY, SECRET_KEY).put_object(Bucket="bucket-0", Key="k", Body=b"x")
    finally:
        stop(service, grace_s=2)  # SeaweedFS takes ~25 s to stop gracefully; what it leaves is the point here
    left = (set(glob.glob("/tmp/seaweedfs-*")) | set(glob.glob("/tmp/weed.*"))) - before
    ports = [str(p) for port in service.extra["ports"].values() for p in (port, port + 10000)]
    assert [p for p in left if any(port in p for port in ports)] == []
    assert not glob.glob(service.extra["tmpdir"])
