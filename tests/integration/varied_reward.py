"""A test reward that always varies within a group: a random tiny model's completions score 0 on the real
rewards (no variance, no advantage, no weight moves), so a test that must see weights move trains on this."""


def text_checksum(completions, **_) -> list[float]:
    """The completion's characters summed, modulo 97, scaled into [0, 1): distinct texts score apart.

    >>> text_checksum(["a", "b", "a"])
    [0.0, 0.010309278350515464, 0.0]
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(sum(map(ord, t)) % 97) / 97 for t in texts]
