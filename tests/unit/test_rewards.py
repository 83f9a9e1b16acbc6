import pytest

from trainer.rewards import correct_answer, number_only, resolve_reward


def test_conversational_completions():
    completions = [[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "3 + 9 = 12"}]]
    assert correct_answer(completions, answer=["12", "12"]) == [1.0, 0.0]
    assert number_only(completions) == [1.0, 0.0]


def test_negative_and_misaligned():
    assert correct_answer(["-4"], answer=["-4"]) == [1.0]
    with pytest.raises(ValueError):
        correct_answer(["1", "2"], answer=["1"])


def test_dotted_path_escape_hatch():
    resolved = resolve_reward("trainer.rewards:number_only")
    assert resolved.__wrapped__ is number_only and resolved(["7"]) == [1.0]
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_reward("trainer.rewards:missing")
