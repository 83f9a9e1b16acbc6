"""Checking: what a canonical row must be to train on. `validate`: no NUL, a prompt with text, an answer the
configured extraction finds and the answer-checking rewards can score; the token bounds count in the model's own
tokens (`prompt_tokens`), or the stage refuses with the fixes (`missing_tokenizer`).
"""

from __future__ import annotations

import re

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from grpo_pipeline.configs.schema import ConfigError, DataConfig
from grpo_pipeline.tasks.data.rows import RowContext, reject_rows
from grpo_pipeline.tasks.data.sources import Reject
from grpo_pipeline.tasks.data.text import PromptTokens
from grpo_pipeline.trainer.rewards import reference_problem

_GSM8K = r"(?s)^.*####\s*(?P<answer>.*?)\s*$"


def extract_answers(answers: pa.Array, cfg: DataConfig) -> pa.Array:
    """The part of each answer the rewards compare against; null where the extraction finds nothing.

    >>> extract_answers(pa.array(["so 1,080 in all\\n#### 1,080", "no marker"]), DataConfig(answer_extraction="gsm8k")).to_pylist()
    ['1080', None]
    """
    if cfg.answer_extraction == "none":
        out = pc.utf8_trim_whitespace(answers)
    else:
        pattern = _GSM8K if cfg.answer_extraction == "gsm8k" else cfg.answer_regex
        assert pattern is not None  # DataConfig requires answer_regex with answer_extraction=regex
        try:
            out = pc.struct_field(pc.extract_regex(answers, pattern), "answer")
        except pa.ArrowInvalid:  # a Python-only regex feature (e.g. lookbehind): match row by row
            compiled = re.compile(pattern)
            found = [compiled.search(a) for a in answers.to_pylist()]
            out = pa.array([m.group("answer") if m else None for m in found], pa.string())
        out = pc.utf8_trim_whitespace(out)
        if cfg.answer_extraction == "gsm8k":
            out = pc.replace_substring(out, ",", "")
    return pc.if_else(pc.equal(out, ""), pa.scalar(None, pa.string()), out)


def _unverifiable(answers: list[str], extras: list[dict], ctx: RowContext) -> list[str | None]:
    """Per reference (an answer and the row's other columns): why the rewards cannot judge it, or None. Each
    reward's own check of a reference speaks first (a label outside the task's labels, a JSON answer that is no
    object, a code row without tests); then each answer-checking reward is offered the reference itself as the
    completion (in TRL's conversational format), with the row's columns: it must score above 0."""
    why: list[str | None] = [None] * len(answers)
    rewards = ctx.rewards
    for i, (answer, extra) in enumerate(zip(answers, extras, strict=True)):
        for name in rewards.names if rewards is not None else ():
            if why[i] is None:
                why[i] = reference_problem(name, rewards.args_for(name) if rewards else None, answer, extra)
    # rows with the same columns are judged in one call; a row whose reward breaks is found one at a time
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, extra in enumerate(extras):
        if why[i] is None:
            groups.setdefault(tuple(sorted(extra)), []).append(i)
    for name, fn in ctx.verifiers.items():
        for columns, rows in groups.items():
            rows = [i for i in rows if why[i] is None]
            completions = [[{"role": "assistant", "content": answers[i]}] for i in rows]
            inputs = {"answer": [answers[i] for i in rows], **{c: [extras[i][c] for i in rows] for c in columns}}
            scores: list[float | str]
            try:
                scores = list(fn(completions, **inputs)) if rows else []
            except Exception:  # find the rows that break it, one at a time
                scores = []
                for j, c in enumerate(completions):
                    try:
                        scores.append(fn([c], **{k: v[j : j + 1] for k, v in inputs.items()})[0])
                    except Exception as exc:
                        scores.append(f"{type(exc).__name__}: {exc}")
            for i, s in zip(rows, scores, strict=True):
                if why[i] is None and (isinstance(s, str) or s is None or not s > 0):
                    why[i] = f"reward '{name}' gives {s!r} to the answer {answers[i]!r} itself"
    return why


def validate(table: pa.Table, cfg: DataConfig, ctx: RowContext) -> tuple[pa.Table, list[Reject]]:
    """Text with NUL, empty prompts, answers the extraction or the rewards cannot use."""
    rejects: list[Reject] = []
    messages = table.column("messages").combine_chunks()
    in_messages = pc.match_substring(messages.flatten().field("content"), "\x00").to_numpy(zero_copy_only=False)
    if in_messages.any() or pc.any(pc.match_substring(table.column("answer"), "\x00")).as_py():
        lengths = pc.list_value_length(messages).to_numpy(zero_copy_only=False)
        nul = np.bincount(np.repeat(np.arange(len(lengths)), lengths), weights=in_messages, minlength=len(lengths)) > 0
        nul |= pc.match_substring(table.column("answer"), "\x00").to_numpy(zero_copy_only=False).astype(bool)
        rejects += reject_rows(table, nul, "nul_character", "U+0000 (NUL) in the prompt or the answer")
        table = table.filter(pa.array(~nul))
    empty = pc.equal(pc.utf8_trim_whitespace(table.column("raw")), "").to_numpy(zero_copy_only=False)
    rejects += reject_rows(table, empty, "empty_prompt", "the prompt has no text")
    table = table.filter(pa.array(~empty))
    extracted = extract_answers(table.column("answer").combine_chunks(), cfg)
    failed = pc.is_null(extracted).to_numpy(zero_copy_only=False)
    how = {
        "none": "the answer is empty",
        "gsm8k": "no '#### <answer>' line in the answer",
        "regex": f"answer_regex {cfg.answer_regex!r} does not match",
    }[cfg.answer_extraction]
    rejects += reject_rows(table, failed, "answer_extraction_failed", how)
    table = table.filter(pa.array(~failed))
    table = table.set_column(table.column_names.index("answer"), "answer", extracted.filter(pa.array(~failed)))
    if (ctx.verifiers or ctx.carried) and table.num_rows:
        # Each distinct reference once: answers repeat a lot (GSM8K: ~50k rows, ~2k distinct answers). A reference
        # is the answer and the row's other columns; NUL, refused above, cannot occur in either.
        extra = table.column("extra").combine_chunks().fill_null("")
        references = pc.dictionary_encode(
            pc.binary_join_element_wise(table.column("answer").combine_chunks(), extra, "\x00")
        )
        unique = [r.partition("\x00") for r in references.dictionary.to_pylist()]
        why_unique = _unverifiable([a for a, _, _ in unique], [orjson.loads(e or "{}") for _, _, e in unique], ctx)
        index = references.indices.to_numpy(zero_copy_only=False)
        bad = np.array([w is not None for w in why_unique], bool)[index] if len(why_unique) else np.zeros(0, bool)
        rejects += reject_rows(
            table, bad, "answer_unverifiable", [why_unique[i] if b else "" for i, b in zip(index, bad, strict=True)]
        )
        table = table.filter(pa.array(~bad))
    return table, rejects


def token_bounds_apply(cfg: DataConfig) -> bool:
    """Whether the configured token bounds need the model's tokenizer: a maximum, or a minimum above one
    token (any prompt that passes the empty-prompt check has at least one).

    >>> token_bounds_apply(DataConfig()), token_bounds_apply(DataConfig(max_prompt_tokens=None))
    (True, False)
    """
    return cfg.max_prompt_tokens is not None or cfg.min_prompt_tokens > 1


def _bounds(cfg: DataConfig) -> str:
    return " and ".join(
        ([f"data.max_prompt_tokens={cfg.max_prompt_tokens}"] if cfg.max_prompt_tokens is not None else [])
        + ([f"data.min_prompt_tokens={cfg.min_prompt_tokens}"] if cfg.min_prompt_tokens > 1 else [])
    )


TOKENS_OFF = "--set data.max_prompt_tokens=null --set data.min_prompt_tokens=0"


def missing_tokenizer(cfg: DataConfig, why: str) -> ConfigError:
    """The error for token bounds that cannot be counted: what is set, why there is no tokenizer, the fixes."""
    return ConfigError(
        f"the token bounds ({_bounds(cfg)}) are counted in the model's own tokens, but {why}. Give the model's "
        "tokenizer (grpo-pipeline data --tokenizer DIR, a directory with tokenizer.json or tokenizer_config.json), "
        f"or drop the bounds ({TOKENS_OFF})"
    )


def prompt_tokens(cfg: DataConfig, tokenizer_path: str | None) -> PromptTokens | None:
    """The token counter the bounds need; refuses (ConfigError) rather than skip a configured bound."""
    if not token_bounds_apply(cfg):
        return None
    if not tokenizer_path:
        raise missing_tokenizer(cfg, "no tokenizer was given")
    try:
        return PromptTokens(tokenizer_path)
    except (OSError, ValueError, TypeError) as exc:  # not a tokenizer directory, or a hub id off the hub
        raise missing_tokenizer(
            cfg,
            f"{tokenizer_path} does not load as one ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})",
        ) from None
