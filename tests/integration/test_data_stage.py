"""The data stage against real services: sources on S3 (SeaweedFS), and the Prefect task's cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_pipeline.configs.schema import ConfigError, DataConfig
from grpo_pipeline.tasks.data.stage import build_dataset
from tests.unit.test_data import question

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": p, "answer": a} for p, a in (question(rng, i) for i in range(n))]


def test_an_s3_prefix_reads_like_the_same_local_files(tmp_path, s3_endpoint, tiny_model):
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(80)
    local = tmp_path / "local"
    local.mkdir()
    (local / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:50]))
    pq.write_table(pa.Table.from_pylist(rows[50:]), local / "b.parquet")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for f in ("a.jsonl", "b.parquet"):
        s3.upload_file(str(local / f), "ckpt", f"data-stage/{f}")

    from_s3 = build_dataset(
        DataConfig(source="s3://ckpt/data-stage/", s3_endpoint_url=s3_endpoint),
        tmp_path / "out-s3",
        str(tiny_model),
    )
    from_disk = build_dataset(DataConfig(source=str(local)), tmp_path / "out-local", str(tiny_model))
    assert from_s3.report.rows_kept == 80
    assert from_s3.fingerprint == from_disk.fingerprint

    with pytest.raises(ConfigError, match="s3_endpoint_url"):
        build_dataset(
            DataConfig(source="s3://no-such-bucket/x.jsonl", s3_endpoint_url=s3_endpoint),
            tmp_path / "out-missing",
            str(tiny_model),
        )


@pytest.mark.slow  # two Prefect flow runs of the data stage: make test-slow (the default run's 12-minute budget)
def test_the_prefect_task_reruns_nothing_on_unchanged_data(tmp_path):  # no token bounds: no tokenizer needed
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(40)))
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from prefect import flow
        import grpo_pipeline.tasks.data.stage as data
        from grpo_pipeline.configs.rewards import RewardSet
        from grpo_pipeline.configs.schema import DataConfig

        builds = []
        real = data.run_chain
        data.run_chain = lambda *a, **k: builds.append(1) or real(*a, **k)

        @flow
        def twice():
            cfg = DataConfig(source={str(data)!r}, max_prompt_tokens=None)
            rewards = RewardSet(names=("correct_answer",))
            states = [data.data_task(cfg, Path({str(tmp_path / "out")!r}), None, rewards, return_state=True)
                      for _ in range(3)]
            return [s.name for s in states], [s.result().fingerprint for s in states]

        names, fingerprints = twice()
        print(json.dumps({{"states": names, "fingerprints": fingerprints, "builds": len(builds)}}))
    """)
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "storage"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # One build; the first rerun finds the content-addressed version on disk, the next is a Prefect cache hit.
    assert result["builds"] == 1
    assert result["states"][-1] == "Cached"
    assert len(set(result["fingerprints"])) == 1
