"""The one way the project builds a boto3 S3 client (checkpoints, data sources, the local stack's S3), and its
retry policy.

The policy: botocore's `standard` retry mode, 4 attempts in all (the first and 3 retries, on throttling and transient
errors, with jittered exponential backoff), a connection given up after 5 s and a read after 60 s. A caller that polls by itself (a
readiness probe: `grpo_pipeline.infra.services`) asks for `attempts=1`, so one poll is one request and its own
deadline holds. Each client comes from a session of its own: boto3's default session caches credentials for the
process's lifetime, which a long training run can outlive.
"""

from __future__ import annotations

from typing import Any

RETRY_MODE = "standard"
ATTEMPTS = 4  # in all, the first included (botocore's total_max_attempts)
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60


def s3_client(
    endpoint_url: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    *,
    region: str | None = None,
    attempts: int = ATTEMPTS,
) -> Any:  # boto3's S3 client (untyped)
    """An S3 client for `endpoint_url` (None: AWS), with the credentials given or, when none are, boto3's own chain
    (environment, profile, instance role).

    >>> client = s3_client("http://127.0.0.1:1", "k", "s", region="us-east-1", attempts=1)
    >>> client.meta.endpoint_url, client.meta.config.retries, client.meta.config.connect_timeout
    ('http://127.0.0.1:1', {'total_max_attempts': 1, 'mode': 'standard'}, 5)
    """
    # boto3 takes most of a second to import: loaded here, only by what talks to S3 (`config`, `plan`, a local run)
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or None,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=Config(
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            retries={"total_max_attempts": attempts, "mode": RETRY_MODE},
        ),
    )
