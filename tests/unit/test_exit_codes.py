"""The trainer's exit codes (docs/reliability.md): how `main` ends an attempt that fails, by its table `EXITS`. Bad
input (2) and a superseded attempt (3) are never relaunched, and bad input prints the tagged line the launchers
read; a reward's outage is 1 (relaunched); anything else is 1 and raised with its traceback. The failures here are
raised where training would raise them (`run`); tests/integration (test_fence, test_warm_start_sky, test_trainer)
reach the same codes through real stores and trainers."""

import pytest

from grpo_pipeline.trainer import train
from grpo_pipeline.trainer.fence import StoreTaken, Superseded
from grpo_pipeline.trainer.rewards import RewardError, RewardUnavailable
from grpo_pipeline.trainer.spec import BAD_INPUT_TAG, EXIT_SUPERSEDED, NOT_RELAUNCHED, JobSpec


@pytest.fixture
def spec_path(tmp_path, tiny_config):
    from grpo_pipeline.tasks.job import model_load, train_settings

    cfg = tiny_config("train.grpo.bf16=false")  # no precision refusal on any CPU: training is reached
    spec = JobSpec(
        model_path=str(tmp_path / "model"),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tmp_path / "train.jsonl"),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
    )
    return str(spec.write(tmp_path / "job.json"))


def _fails_with(monkeypatch, error):
    def run(spec, started=None):
        raise error

    monkeypatch.setattr(train, "run", run)


@pytest.mark.parametrize(
    "error, code, tagged",
    [
        (RewardUnavailable("reward 'remote_verifier': http://grader:8000 did not answer after 3 tries"), 1, False),
        (RewardError("reward 'x:nan' returned nan for row 1"), 2, True),
        (StoreTaken("s3://b/p is managed job 7's, which still runs"), 2, True),
        (Superseded("a newer attempt claimed s3://b/p"), EXIT_SUPERSEDED, False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_each_failure_ends_with_its_code(spec_path, monkeypatch, capsys, caplog, error, code, tagged):
    _fails_with(monkeypatch, error)
    assert train.main(spec_path) == code
    out = capsys.readouterr().out
    assert (BAD_INPUT_TAG in out) is tagged  # what stops a launcher's relaunch
    assert (str(error) in out) is tagged
    assert str(error) in caplog.text  # the reason in the log, for every code


def test_any_other_failure_is_exit_1_with_its_traceback(spec_path, monkeypatch, capsys):
    _fails_with(monkeypatch, OSError("No space left on device"))
    with pytest.raises(OSError, match="No space left"):  # python -m exits 1, the traceback on stderr
        train.main(spec_path)
    assert BAD_INPUT_TAG not in capsys.readouterr().out


def test_the_table_names_an_outage_before_the_reward_error_it_subclasses():
    """First match wins: a RewardUnavailable is a RewardError, and must not be taken for bad input."""
    kinds = [kind for kind, _, _ in train.EXITS]
    assert kinds.index(RewardUnavailable) < kinds.index(RewardError)


def test_the_codes_are_defined_once_in_the_job_contract_and_the_launchers_read_them_there():
    """trainer/spec.py alone assigns an EXIT_ name in trainer/ and infra/ (the trainer, its torchrun launcher and
    the local launcher once each defined or typed them), and a code is compared by name, never as a literal."""
    import ast
    from pathlib import Path

    from grpo_pipeline.infra.launch import local

    root = Path(__file__).resolve().parents[2]
    assigned, literal = [], []
    for path in sorted([*(root / "trainer").rglob("*.py"), *(root / "infra").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                if any(n.startswith("EXIT_") for n in names) and path.name != "spec.py":
                    assigned.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.Compare) and any(
                isinstance(n, ast.Name) and n.id == "code" for n in [node.left, *node.comparators]
            ):
                if any(isinstance(n, ast.Constant) and n.value in (1, 2, 3, 75) for n in node.comparators):
                    literal.append(f"{path.relative_to(root)}:{node.lineno}")
    assert assigned == [] and literal == [], (assigned, literal)
    assert NOT_RELAUNCHED == {2, EXIT_SUPERSEDED} and local.NOT_RELAUNCHED is NOT_RELAUNCHED
