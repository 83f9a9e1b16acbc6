"""A test reward for daily retraining: the completion's length in characters, tenths. A random tiny model's
answers are never right, so a correctness reward gives every completion of a group the same 0 and GRPO no
gradient; length differs between sampled completions, so the adapter moves every step."""


def completion_length(completions, **_) -> list[float]:
    """
    >>> completion_length(["abc", [{"role": "assistant", "content": "abcdefghij"}]])
    [0.3, 1.0]
    """
    texts = [c if isinstance(c, str) else "".join(m.get("content", "") for m in c) for c in completions]
    return [len(t) / 10 for t in texts]
