"""The one prompt renderer: how a prompt becomes the text a model generates from, for the pipeline's evaluation
(`grpo_pipeline.tasks.evaluate`) and for the registered MLflow model (`serving_model.py`), so the serving check
compares what the evaluation generated with what the same rendering serves.

Standard library only and no import of the project: MLflow ships this file beside `serving_model.py` in every
logged model (`code_paths`), where it is imported as the top-level module `chat_prompts`.
"""

import json
from typing import Any


def as_messages(prompt: object) -> list[dict]:
    """One prompt as chat messages: a list of message dicts as it is, one message dict as a list of it, JSON
    text of such a list parsed, any other text one user turn.

    >>> as_messages("What is 2 + 3?")
    [{'role': 'user', 'content': 'What is 2 + 3?'}]
    >>> as_messages('[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]')[0]["role"]
    'system'
    """
    if isinstance(prompt, dict):
        return [prompt]  # a lone message
    if isinstance(prompt, list):
        return prompt
    text = str(prompt)
    if text.lstrip().startswith("["):
        try:
            messages = json.loads(text)
            if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
                return messages
        except ValueError:
            pass
    return [{"role": "user", "content": text}]


def render(tokenizer: Any, prompts: list) -> list[str]:  # Any: a transformers tokenizer, not imported here
    """Prompts (any shape `as_messages` reads) as the model's own chat template writes them, ready for
    generation."""
    return [tokenizer.apply_chat_template(as_messages(p), tokenize=False, add_generation_prompt=True) for p in prompts]


def prompt_text(messages: list[dict]) -> str:
    """Chat messages as the served model's string input: the text of a lone user message, else the messages as
    JSON; always a text `as_messages` reads back as these same messages, so the served model renders exactly
    what the evaluation rendered.

    >>> prompt_text([{"role": "user", "content": "What is 2 + 3?"}])
    'What is 2 + 3?'
    >>> prompt_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    '[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]'
    >>> tricky = [{"role": "user", "content": '[{"role": "system", "content": "x"}]'}]  # reads as other messages
    >>> as_messages(prompt_text(tricky)) == tricky
    True
    """
    if len(messages) == 1 and messages[0].get("role") == "user":
        text = messages[0].get("content")
        if isinstance(text, str) and as_messages(text) == messages:
            return text
    return json.dumps(messages)
