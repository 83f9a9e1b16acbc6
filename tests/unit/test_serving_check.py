"""The serving check hands its prompts to the clean process on stdin: 1 MiB of prompts arrives whole and in
order, and none of it is on a command line (over 128 KiB in one argument failed with E2BIG, after the version
was registered, and argv shows in `ps`). MLflow is stood in for by a stub module that echoes the prompts, so
the real check script runs in a second or two; the integration tests run it against a real MLflow model."""

import json
import subprocess

import pytest

from grpo_pipeline.tasks.promote import serving

FAKE_MLFLOW = """
import types

def set_tracking_uri(uri):
    pass

class _Echo:
    def predict(self, frame, params=None):
        return list(frame["prompt"])

pyfunc = types.SimpleNamespace(load_model=lambda uri: _Echo())
"""


def test_a_megabyte_of_prompts_goes_through_stdin_never_argv(tmp_path, monkeypatch):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "mlflow.py").write_text(FAKE_MLFLOW)
    real_env, real_run, argv = serving.isolated_env, subprocess.run, []

    def env_with_stub(*args, **kwargs):
        env = real_env(*args, **kwargs)
        return env | {"PYTHONPATH": f"{env['PYTHONPATH']}:{stub}"}

    def recording_run(args, **kwargs):
        argv.append(args)
        return real_run(args, **kwargs)

    monkeypatch.setattr(serving, "isolated_env", env_with_stub)
    monkeypatch.setattr(serving.subprocess, "run", recording_run)
    rows = [
        {"key": f"k{i}", "prompt": [{"role": "user", "content": f"{i:04d}" + "x" * (16 << 10)}]} for i in range(64)
    ]  # 1 MiB
    expected = [r["prompt"][0]["content"] for r in rows]
    check = serving.serving_check(
        "models:/m/1", "http://127.0.0.1:9", rows, expected, max_new_tokens=4, batch_size=8, timeout_s=300
    )
    assert check.error is None and check.passed and check.matched == 64, check
    assert sum(len(a) for a in argv[0]) < 4096 and "xxxx" not in " ".join(argv[0])


class _TemplateProbe:
    """A tokenizer whose chat template writes out everything a template can read (the messages and the flags), so
    two renderings are equal under it exactly when they are equal under every chat template."""

    def apply_chat_template(self, messages, **flags):
        return json.dumps([messages, flags], sort_keys=True)


CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": '[{"role": "system", "content": "a user who writes JSON"}]'}],  # reads as a chat
    [{"role": "user", "content": "  [1, 2] is a list"}],
    [{"role": "user", "content": "Hi", "name": "alice"}],  # a field beside role and content
]


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_the_served_model_renders_what_the_evaluation_rendered(chat):
    """The serving check compares the evaluation's completions with the served model's for the same prompt: the
    served model is given `prompt_text` of the chat and renders it with the evaluation's own renderer, which must
    hand the chat template the very messages the evaluation did, whatever the template."""
    from grpo_pipeline.tasks.chat_prompts import render

    probe = _TemplateProbe()
    assert render(probe, [serving.prompt_text(chat)]) == render(probe, [chat])
    assert serving.prompt_text is evaluate_renderer_module().prompt_text  # one renderer, not a copy


def evaluate_renderer_module():
    from grpo_pipeline.tasks import chat_prompts, evaluate

    assert evaluate.render is chat_prompts.render
    return chat_prompts
