"""A warm start on a SkyPilot node: the launcher's upload of the adapter into the run's store (a real S3 API,
SeaweedFS) and the node's trainer fetching it, each file checked against the hashes its job spec pins; real
training on the tiny random Llama, as the node would run it (its job.json, `python -m grpo_pipeline.trainer`'s main)."""

import hashlib
import json

import boto3
import pytest

from grpo_pipeline.infra.launch.skypilot import node_spec, publish_init_adapter
from grpo_pipeline.trainer.checkpoints import INIT_ADAPTER, MANIFEST, CheckpointCorrupt, S3Store, fetch_init_adapter
from tests.integration.test_warm_start import _parent_adapter, _spec, _weights

pytestmark = pytest.mark.integration


def _node_job(tmp_path, tiny_model, tiny_splits, cfg, prefix, s3_endpoint):
    """The job as the sky launcher ships it: the adapter published to the run's store, the node's spec (paths
    that exist here, as a node's would there) pinning its files."""
    parent = _parent_adapter(tiny_model, tmp_path / "parent")
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg, parent)
    spec = spec.model_copy(update={"checkpoint_uri": f"s3://ckpt/{prefix}"})
    publish_init_adapter(spec)
    shipped = node_spec(spec).model_copy(
        update={k: getattr(spec, k) for k in ("model_path", "train_file", "val_file", "work_dir", "adapter_dir")}
    )
    return parent, shipped


def _rewrite(s3_endpoint, prefix, name, body):
    """What a hostile (or careless) store holder does: replace a file and, to pass the store's own check, its
    manifest entry too."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    key = f"{prefix}/{INIT_ADAPTER}"
    if ".." not in name.split("/"):  # S3 refuses such a key; the manifest alone can still name it
        s3.put_object(Bucket="ckpt", Key=f"{key}/{name}", Body=body)
    manifest = json.loads(s3.get_object(Bucket="ckpt", Key=f"{key}/{MANIFEST}")["Body"].read())
    manifest["files"][name] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    s3.put_object(Bucket="ckpt", Key=f"{key}/{MANIFEST}", Body=json.dumps(manifest).encode())


def test_the_node_trains_from_the_published_adapter(tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import main

    cfg = tiny_config(
        "train.grpo.max_steps=1",
        "train.checkpoint_every=1",
        f"train.s3_endpoint_url={s3_endpoint}",
        "train.rewards=[{name: 'tests.integration.varied_reward:text_checksum', role: skill}]",  # varies: weights move
    )
    parent, shipped = _node_job(tmp_path, tiny_model, tiny_splits, cfg, "warm-ok", s3_endpoint)
    assert main(str(shipped.write(tmp_path / "job.json"))) == 0

    before, after = _weights(parent), _weights(tmp_path / "adapter")
    b = next(k for k in before if "lora_B" in k)
    assert before.keys() == after.keys() and 0 < (after[b] - before[b]).abs().max().item()  # continued, trained


def test_a_swapped_file_in_the_store_is_refused_with_exit_2(
    tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config, capsys
):
    from grpo_pipeline.trainer.spec import EXIT_BAD_INPUT
    from grpo_pipeline.trainer.train import main

    cfg = tiny_config(f"train.s3_endpoint_url={s3_endpoint}")
    _, shipped = _node_job(tmp_path, tiny_model, tiny_splits, cfg, "warm-swapped", s3_endpoint)
    _rewrite(s3_endpoint, "warm-swapped", "adapter_config.json", b'{"r": 4, "base_model_name_or_path": "evil"}')

    assert main(str(shipped.write(tmp_path / "job.json"))) == EXIT_BAD_INPUT
    out = capsys.readouterr().out
    assert "'adapter_config.json' does not match the sha256 the job spec pins" in out
    assert not (tmp_path / "adapter").exists()  # nothing trained


@pytest.mark.parametrize(
    "name, expected",
    [
        ("extra.py", r"has files the job spec does not pin: \['extra.py'\]"),
        ("../outside.txt", "has a '..' part"),
    ],
)
def test_an_added_or_escaping_file_is_refused_and_nothing_lands_outside(
    tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config, name, expected
):
    cfg = tiny_config(f"train.s3_endpoint_url={s3_endpoint}")
    prefix = f"warm-added-{len(name)}"
    _, shipped = _node_job(tmp_path, tiny_model, tiny_splits, cfg, prefix, s3_endpoint)
    _rewrite(s3_endpoint, prefix, name, b"print('hi')")

    store = S3Store(f"s3://ckpt/{prefix}", endpoint_url=s3_endpoint)
    with pytest.raises(CheckpointCorrupt, match=expected):
        fetch_init_adapter(store, shipped.init_adapter_files, tmp_path / "node" / "init")
    assert not (tmp_path / "node" / "outside.txt").exists()


def test_a_missing_file_is_refused(tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config):
    cfg = tiny_config(f"train.s3_endpoint_url={s3_endpoint}")
    _, shipped = _node_job(tmp_path, tiny_model, tiny_splits, cfg, "warm-missing", s3_endpoint)
    pinned = {**shipped.init_adapter_files, "tokenizer.json": (10, "0" * 64)}

    store = S3Store("s3://ckpt/warm-missing", endpoint_url=s3_endpoint)
    with pytest.raises(CheckpointCorrupt, match="lacks 'tokenizer.json', which the job spec pins"):
        fetch_init_adapter(store, pinned, tmp_path / "node" / "init")
