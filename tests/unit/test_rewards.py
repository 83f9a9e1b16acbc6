"""The reward library on hand-written completions of the kinds models write: right, wrong, malformed, empty,
very long, non-ASCII digits; and the checks every resolved reward makes on each call."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.tasks.evaluate import contrast, pick_examples, score
from grpo_pipeline.trainer.rewards import (
    REWARDS,
    RewardError,
    RewardUnavailable,
    check_columns,
    correct_answer,
    describe,
    near_answer,
    number_only,
    resolve_reward,
    resolve_rewards,
)

ROOT = Path(__file__).resolve().parents[2]
COT = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
    "in April and May.\n#### 72"
)


def test_conversational_completions():
    completions = [[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "3 + 9 = 12"}]]
    assert correct_answer(completions, answer=["12", "12"]) == [1.0, 1.0]  # the final answer, whatever the format
    assert number_only(completions) == [1.0, 0.0]


def test_negative_and_misaligned():
    assert correct_answer(["-4"], answer=["-4"]) == [1.0]
    with pytest.raises(ValueError):
        correct_answer(["1", "2"], answer=["1"])


def test_near_answer_ranks_wrong_answers_by_distance_and_never_pays_more_than_right():
    scores = near_answer(["The next one is 20.", "19", "25", "-20", "twenty", "20"], answer=["20"] * 6)
    assert scores[0] == scores[5] == 1.0  # right, whatever the words around it
    assert 1.0 > scores[1] > scores[2] > 0.0 and scores[3] == scores[4] == 0.0
    assert near_answer(["1", "3"], answer=["0", "0"]) == [0.0, 0.0]  # a zero reference: distance in units
    assert near_answer(["0.5", "7"], answer=["1/2", "an hour"]) == [1.0, 0.0]  # not a number: no credit


def test_dotted_path_escape_hatch():
    resolved = resolve_reward("grpo_pipeline.trainer.rewards:number_only")
    assert resolved.__wrapped__ is number_only and resolved(["7"]) == [1.0]
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_reward("grpo_pipeline.trainer.rewards:missing")


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        (COT, "72", 1.0),  # GSM8K's own solution: the #### line, not 24
        ("First 48/2 = 24, then 48 + 24 = 72. So she sold 72 clips.", "72", 1.0),  # last number, not the first
        ("<think>48/2 = 24 and 48 + 24 = 72</think>\n<answer>72</answer>", "72", 1.0),
        (
            "<think>maybe 70</think><answer>The answer is $1,080.00.</answer>",
            "1080",
            1.0,
        ),  # currency, separator, decimals
        ("so the total is \\boxed{\\frac{3}{4}} of the cake", "0.75", 1.0),
        ("The probability is 3/4", "0.75", 1.0),
        ("It is 25%.", "25", 1.0),
        ("<answer>٧٢</answer>", "72", 1.0),  # Arabic-Indic digits
        ("The answer is ７２.", "72", 1.0),  # full-width digits
        ("The change is −5 dollars", "-5", 1.0),  # a Unicode minus
        ("The change is 5 dollars", "-5", 0.0),  # a sign is not noise
        ("48 + 24 = 71", "72", 0.0),
        ("<answer>seventy-two</answer>", "72", 0.0),  # words are not the number
        ("<answer>72", "72", 1.0),  # unclosed tag: the last number still counts
        ("", "72", 0.0),
        ("I cannot solve this.", "72", 0.0),
        ("Step. " * 5000 + "So 72.", "72", 1.0),  # very long
        ("Step 1. " * 5000, "72", 0.0),
    ],
)
def test_math_answer(completion, reference, expected):
    assert resolve_reward("math_answer")([completion], answer=[reference]) == [expected]


def test_math_answer_latex_goes_to_math_verify():
    fn = resolve_reward("math_answer")
    assert fn(["\\boxed{\\frac{1}{\\sqrt{2}}}", "\\boxed{\\sqrt{3}}"], answer=["\\frac{\\sqrt{2}}{2}"] * 2) == [
        1.0,
        0.0,
    ]


def test_math_answer_custom_tag():
    fn = resolve_reward("math_answer", {"answer_tag": "final"})
    assert fn(["<final>7</final> and later 9"], answer=["7"]) == [1.0]
    with pytest.raises(RewardError, match="answer_tag"):
        resolve_reward("math_answer", {"answer_tag": "a b"})(["x"], answer=["1"])


@pytest.mark.parametrize(
    "completion, lenient, strict",
    [
        ("<think>\n48/2 = 24\n</think>\n<answer>\n72\n</answer>", 1.0, 1.0),
        ("<think>48/2 = 24</think> The answer is 72.", 1.0, 0.0),  # plain answer: lenient only
        ("  <think>x</think><answer>72</answer>  ", 1.0, 1.0),  # whitespace around is fine
        ("<think></think><answer>72</answer>", 0.0, 0.0),  # empty reasoning
        ("<think>x</think>", 0.0, 0.0),  # no answer
        ("<think>x</think><answer> </answer>", 1.0, 0.0),
        ("So <think>x</think><answer>72</answer>", 0.0, 0.0),  # text before the block
        ("<think>a</think><think>b</think><answer>72</answer>", 0.0, 0.0),  # a second attempt
        ("<think>x</think><answer>72</answer> extra", 1.0, 0.0),
        ("<think>x<answer>72</answer>", 0.0, 0.0),  # unclosed
        ("", 0.0, 0.0),
        ("72", 0.0, 0.0),
    ],
)
def test_think_format(completion, lenient, strict):
    assert resolve_reward("think_format")([completion]) == [lenient]
    assert resolve_reward("think_format_strict")([completion]) == [strict]


def test_think_format_custom_tags():
    fn = resolve_reward("think_format_strict", {"think_tag": "reasoning", "answer_tag": "final"})
    assert fn(["<reasoning>r</reasoning><final>1</final>", "<think>r</think><answer>1</answer>"]) == [1.0, 0.0]


def test_overlong_penalty_from_token_ids_and_the_run_limit():
    fn = resolve_reward("overlong_penalty", {"buffer": 4}, max_completion_length=10)
    assert fn(["a"] * 5, completion_ids=[[1] * n for n in (3, 6, 8, 10, 12)]) == [0.0, 0.0, -0.5, -1.0, -1.0]
    default_buffer = resolve_reward("overlong_penalty", max_completion_length=100)  # a fifth of the limit
    assert default_buffer(["a", "b"], completion_lengths=[80, 90]) == [0.0, -0.5]
    with pytest.raises(RewardError, match="max_completion_length"):
        resolve_reward("overlong_penalty")(["a"], completion_lengths=[3])
    with pytest.raises(RewardError, match="token lengths"):
        resolve_reward("overlong_penalty", max_completion_length=10)(["a"])


def test_arguments_are_checked_by_name():
    with pytest.raises(RewardError, match="takes no argument 'tag'; its arguments: answer_tag='answer'"):
        resolve_reward("math_answer", {"tag": "x"})
    with pytest.raises(RewardError, match="needs the argument url"):
        resolve_reward("remote_verifier")
    with pytest.raises(RewardError, match="not among the rewards"):
        resolve_rewards(["math_answer"], {"think_format": {}})


def bad_raises(completions, answer, **_):
    return [1.0 / (len(a) - 2) for a in answer]  # ZeroDivisionError on a two-character answer


def bad_count(completions, **_):
    return [0.0]


def bad_nan(completions, **_):
    return [float("nan") if "?" in c else 1.0 for c in completions]


def bad_inf(completions, **_):
    return [math.inf] * len(completions)


def bad_none(completions, **_):
    return [None] * len(completions)


def bad_type(completions, **_):
    return 1.0


def test_a_failing_reward_names_itself_and_the_row():
    here = __name__
    rows = {"answer": ["123", "12", "4567"], "key": ["k0", "k1", "k2"]}
    with pytest.raises(
        RewardError, match=rf"reward '{here}:bad_raises' raised on row 1 \(key k1\), completion 'b': ZeroDivisionError"
    ):
        resolve_reward(f"{here}:bad_raises")(["a", "b", "c"], **rows)
    with pytest.raises(RewardError, match="returned 1 scores for 3 completions"):
        resolve_reward(f"{here}:bad_count")(["a", "b", "c"])
    with pytest.raises(RewardError, match=r"returned nan for row 1 \(key k1\), completion 'why\?'"):
        resolve_reward(f"{here}:bad_nan")(["ok", "why?"], key=["k0", "k1"])
    with pytest.raises(RewardError, match="returned inf for row 0"):
        resolve_reward(f"{here}:bad_inf")(["a"])
    with pytest.raises(RewardError, match="returned None for row 0"):
        resolve_reward(f"{here}:bad_none")(["a"])
    with pytest.raises(RewardError, match="returned float, not a list"):
        resolve_reward(f"{here}:bad_type")(["a"])


def test_a_failure_that_repeats_is_bad_input_not_an_outage():
    """Every failure above would repeat on a relaunch: a RewardError that is not a RewardUnavailable (exit 2)."""
    here = __name__
    for reward, completions in (("bad_raises", ["a", "b"]), ("bad_nan", ["why?"]), ("bad_count", ["a", "b"])):
        with pytest.raises(RewardError) as failed:
            resolve_reward(f"{here}:{reward}")(completions, answer=["123", "12"][: len(completions)])
        assert not isinstance(failed.value, RewardUnavailable), reward
    with pytest.raises(RewardError) as failed:
        resolve_reward("math_answer")(["72"], solution=["72"])  # a missing column
    assert not isinstance(failed.value, RewardUnavailable)


CALLS: list[int] = []


def flaky_network(completions, **_):
    CALLS.append(len(completions))
    raise ConnectionResetError(104, "Connection reset by peer")


def out_of_memory(completions, **_):
    import torch

    CALLS.append(len(completions))
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def unavailable(completions, **_):
    raise RewardUnavailable("the judge's queue is full")


def test_an_outage_or_exhausted_memory_is_retryable_and_not_rerun_row_by_row():
    """A connection reset, a timeout or an OOM says nothing about the rows: a RewardUnavailable (the trainer
    exits 1 and a relaunch resumes), raised after one call (a rerun per row would call the service n times)."""
    here = __name__
    for reward, kind in (("flaky_network", "ConnectionResetError"), ("out_of_memory", "OutOfMemoryError")):
        CALLS.clear()
        with pytest.raises(
            RewardUnavailable,
            match=rf"^reward '{here}:{reward}' could not run on a batch of 3 "
            rf"completions: {kind}",
        ):
            resolve_reward(f"{here}:{reward}")(["a", "b", "c"])
        assert CALLS == [3]
    with pytest.raises(RewardUnavailable, match=rf"^reward '{here}:unavailable': the judge's queue is full$"):
        resolve_reward(f"{here}:unavailable")(["a"])


def test_a_missing_column_is_named_before_the_reward_runs():
    with pytest.raises(
        RewardError,
        match="'math_answer' needs the column 'answer', which the data does not have "
        r"\(it has: key, solution\)",
    ):
        resolve_reward("math_answer")(["72"], solution=["72"], key=["k"], trainer_state=None)
    check_columns(["math_answer", "think_format", "overlong_penalty"], ["prompt", "answer", "key"])
    with pytest.raises(RewardError, match="'math_answer' needs the column 'answer'"):
        check_columns(["think_format", "math_answer"], ["prompt", "key"])


def test_trl_sees_the_reward_name_and_the_data_stage_its_signature():
    import inspect

    from trl.trainer.utils import get_callable_name

    fn = resolve_reward("math_answer", {"answer_tag": "final"})
    assert get_callable_name(fn) == "math_answer"  # TRL logs rewards/math_answer/mean
    assert "answer" in inspect.signature(fn).parameters  # the data stage's verifiability check looks for it


def test_every_registered_reward_is_described():
    import inspect

    for name, fn in REWARDS.items():
        entry = describe(name)
        assert entry["statement"].endswith("."), name  # one line: what it checks
        assert ">>>" in inspect.getdoc(fn), f"{name} has no doctest"
    assert describe("math_answer")["columns"] == ["answer"]
    assert describe("remote_verifier")["arguments"]["url"] == "required"


def test_reward_weights_in_their_entries_reach_trl_in_reward_order():
    cfg = load_config(None, ["train.rewards=[math_answer, {name: think_format, weight: 0.25}, overlong_penalty]"])
    assert cfg.train.reward_set().weights == (1.0, 0.25, 1.0)
    with pytest.raises(ConfigError, match="train.grpo.reward_weights: a reward's weight and arguments are set"):
        load_config(None, ["train.grpo.reward_weights=[1, 0.5]"])
    with pytest.raises(ConfigError, match="is not a finite number"):
        load_config(None, ["train.rewards=[correct_answer, {name: number_only, weight: .nan}]"])
    with pytest.raises(ConfigError, match="names number_only more than once"):
        load_config(None, ["train.rewards=[correct_answer, number_only, number_only]"])


def test_evaluation_scores_with_the_training_rewards():
    rows = [
        {"prompt": [{"role": "user", "content": "48 + 24?"}], "answer": "72", "key": "a"},
        {"prompt": [{"role": "user", "content": "5 - 9?"}], "answer": "-4", "key": "b"},
    ]
    completions = ["<think>48 + 24 = 72</think><answer>72</answer>", "<think>5 - 9 = 4</think><answer>4</answer>"]
    result = score(
        rows,
        completions,
        RewardSet(names=("math_answer", "think_format", "overlong_penalty"), weights=(1.0, 0.5, 1.0)),
        [12, 16],
        max_completion_length=16,
    )
    assert [r["total"] for r in result.rows] == [1.5, -0.5]  # 1 + 0.5; 0 + 0.5 - 1 (cut at the limit)
    assert result.per_reward == {"math_answer": 0.5, "think_format": 1.0, "overlong_penalty": -0.5}
    assert result.rows[0]["prompt"] == "48 + 24?" and result.rows[1]["answer"] == "-4"
    think_only = RewardSet(entries=[{"name": "think_format", "role": "skill"}])
    extra = score(rows, completions, think_only, [3, 3], extra=["math_answer"])
    assert extra.rows[0]["math_answer"] == 1.0 and extra.per_reward == {"think_format": 1.0}
    assert [e["verdict"] for e in pick_examples(result, "math_answer", 3)] == ["right", "wrong"]
    fixed = contrast(result, score(rows, ["no", "no"], RewardSet(names=("math_answer",)), [1, 1]), "math_answer")
    assert [e["key"] for e in fixed["fixed"]] == ["a"] and fixed["broken"] == []


def _cli(*args: str):
    """`grpo-pipeline rewards ...` in this process (typer's runner): exit code, stdout and stderr as a user sees
    them, without a Python start-up and the training stack's imports per call. The last test runs it for real."""
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    return CliRunner().invoke(app, ["rewards", *args])


def test_rewards_cli_lists_and_checks(tmp_path):
    listed = _cli("--json")
    assert listed.exit_code == 0, listed.stderr
    assert {e["name"] for e in json.loads(listed.stdout)} == set(REWARDS)
    samples = tmp_path / "samples.jsonl"
    samples.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"completion": "<think>48 + 24</think><answer>72</answer>", "answer": "72", "prompt": "48 + 24?"},
                {"completion": [{"role": "assistant", "content": "So 1,234.0 in all"}], "answer": "1234"},
                {"completion": "no idea", "answer": "5"},
            ]
        )
    )
    checked = _cli("check", "math_answer", "--input", str(samples), "--json")
    assert checked.exit_code == 0, checked.stderr
    assert json.loads(checked.stdout)["scores"] == [1.0, 1.0, 0.0]
    table = _cli("check", "think_format_strict", "--input", str(samples))
    assert table.exit_code == 0 and "mean 0.3333" in table.stdout


def test_rewards_cli_bad_input_exits_2_and_a_failing_reward_1(tmp_path):
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"completion": "72", "solution": "72"}) + "\n")
    assert _cli("check", "nope", "--input", str(samples)).exit_code == 2
    assert _cli("check", "math_answer", "--input", str(tmp_path / "absent.jsonl")).exit_code == 2
    assert _cli("check", "math_answer", "--input", str(samples), "--arg", "bogus=1").exit_code == 2
    failing = _cli("check", f"{__name__}:bad_nan", "--input", str(samples), "--json")
    assert failing.exit_code == 0  # no '?' in the completion: a finite score
    samples.write_text(json.dumps({"completion": "why?"}) + "\n")
    failing = _cli("check", "tests.unit.test_rewards:bad_nan", "--input", str(samples), "--json")
    assert failing.exit_code == 1 and "returned nan for row 0" in json.loads(failing.stdout)["error"]


def test_rewards_cli_exits_2_as_a_process_on_a_missing_column(tmp_path):
    """The console script for real once: a process's exit code and its JSON failure on stdout."""
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"completion": "72", "solution": "72"}) + "\n")
    missing = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "rewards", "check", "math_answer", "--input", str(samples)]
        + ["--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "needs the column 'answer'" in json.loads(missing.stdout)["error"]
