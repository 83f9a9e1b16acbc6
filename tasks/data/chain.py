"""The stateful part of the data stage, batch at a time: what has been kept so far decides what a new row
duplicates. `Chain.feed` takes a source's batch through reading (`rows`) and checking (`checks`), then exact and
key dedup, the token bounds, near dedup and the split (`split_of`): val and holdout rows are written at once and
their n-grams kept; train rows wait in an Arrow IPC file until `Chain.finish` checks them for contamination and
writes them.

Both checks judge what varies between rows, not what the rows share: a `data.template_ngram`-gram held by at least
`data.template_min_rows` rows of a batch is template (a fixed instruction around varying inputs), and near-dedup and
contamination compare each row's `varying_words` (its words with each run of template words made one word).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from grpo_pipeline.configs.schema import DataConfig
from grpo_pipeline.tasks.data.checks import validate
from grpo_pipeline.tasks.data.rows import CANONICAL, RowContext, canonical_batch, reject_rows
from grpo_pipeline.tasks.data.sources import RawBatch, Reject
from grpo_pipeline.tasks.data.splits import jsonl_line, split_of
from grpo_pipeline.tasks.data.text import (
    NearDuplicateIndex,
    PromptTokens,
    document_frequency,
    ngram_hashes,
    normalize,
    overlap_fraction,
    sorted_unique,
    varying_ngrams,
    words,
)

REFERENCE = pa.schema([("raw", pa.string())])
# The drop reasons that say a row itself is broken, whatever the rows around it: what `data.max_malformed_per_file`
# counts in each file. Duplicates, token bounds and contamination depend on the other rows and the model.
MALFORMED = frozenset(
    {
        "bad_json",
        "invalid_utf8",
        "line_too_long",
        "too_deep",
        "nul_character",
        "bad_csv",
        "missing_field",
        "wrong_type",
        "empty_prompt",
        "answer_extraction_failed",
        "answer_unverifiable",
    }
)


class Chain:
    """Stateful, batch-at-a-time: what has been kept so far decides what a new row duplicates."""

    def __init__(self, cfg: DataConfig, ctx: RowContext, tokens: PromptTokens | None, work: Path):
        self.cfg, self.ctx, self.tokens = cfg, ctx, tokens
        # 96-bit hashes of normalized prompts seen so far -> the kept row's key. With default keys (the
        # prompt's own hash) the key is implied, so a set of ints holds the same at a third of the memory.
        self.seen_text: dict[int, str] | set[int] = {} if cfg.key_column else set()
        self.seen_keys: set[str] = set()
        self.near = (
            NearDuplicateIndex(cfg.near_dup_threshold, cfg.near_dup_num_perm) if cfg.near_dup_threshold else None
        )
        # Template n-grams (sorted hashes) of the batches seen so far, see `_learn_template`.
        self.template = np.empty(0, np.uint64)
        # The evaluation sets' n-grams; the holdout and val prompts wait in an Arrow IPC file, since what is
        # template is known only when the last batch is in.
        self.reference: list[np.ndarray] = []
        self.dropped: Counter[str] = Counter()
        self.rows_read = 0
        # per source file: rows read, and those dropped as MALFORMED (data.max_malformed_per_file)
        self.read_by_file: Counter[str] = Counter()
        self.malformed_by_file: Counter[str] = Counter()
        self.kept: Counter[str] = Counter()
        self.work = work
        self.quarantine = (work / "quarantine.jsonl").open("wb")
        self.outputs = {s: (work / f"{s}.jsonl").open("wb") for s in ("val", "holdout")}
        self.pending_path = work / "train.pending.arrow"
        self.pending = pa.ipc.new_stream(str(self.pending_path), CANONICAL)
        self.reference_path = work / "reference.pending.arrow"
        self.reference_texts = pa.ipc.new_stream(str(self.reference_path), REFERENCE)

    def drop(self, rejects: list[Reject]) -> None:
        for r in rejects:
            self.dropped[r.reason] += 1
            if r.reason in MALFORMED:
                self.malformed_by_file[r.source] += 1
            self.quarantine.write(jsonl_line(r.as_dict()))

    def feed(self, raw: RawBatch) -> None:
        self.rows_read += len(raw.positions) + len(raw.rejects)
        self.read_by_file[raw.source] += len(raw.positions) + len(raw.rejects)
        table, rejects = canonical_batch(raw, self.cfg, self.ctx)
        self.drop(rejects)
        if table.num_rows:
            table, rejects = validate(table, self.cfg, self.ctx)
            self.drop(rejects)
        if table.num_rows:
            self._dedup_and_split(table)

    def _dedup_and_split(self, table: pa.Table) -> None:
        """A checked batch through exact and key dedup, the token bounds and near dedup into the split: each step
        drops (into the quarantine) what it rejects."""
        table, keys = self._exact_dedup(table)
        # Rows dropped from here on have registered their text and key: a later copy is still a duplicate
        # of a dropped row, which is what it is.
        if self.tokens is not None and table.num_rows:
            table, keys = self._token_bounds(table, keys, self.tokens)
        if self.near is not None and table.num_rows:
            table, keys = self._near_dedup(table, keys, self.near)
        if table.num_rows:
            self._split(table, keys)

    def _exact_dedup(self, table: pa.Table) -> tuple[pa.Table, list[str]]:
        """The rows whose normalized prompt and key no earlier row has, and their keys (a missing key becomes the
        normalized prompt's hash); every row's prompt and key are registered, whatever comes of the row later."""
        norm = normalize(table.column("raw").combine_chunks()).to_pylist()
        keys = table.column("key").to_pylist()
        keep = np.ones(len(norm), bool)
        exact_detail: list[str] = [""] * len(norm)
        key_detail: list[str] = [""] * len(norm)
        for i, text in enumerate(norm):
            digest = hashlib.sha256(text.encode()).digest()
            if keys[i] is None:
                keys[i] = digest[:8].hex()  # the default key: the normalized prompt's hash
            text_id = int.from_bytes(digest[:12], "big")
            if text_id in self.seen_text:
                keep[i] = False
                first = self.seen_text[text_id] if isinstance(self.seen_text, dict) else keys[i]
                exact_detail[i] = f"same prompt as the kept row with key {first}"
            elif isinstance(self.seen_text, set):
                self.seen_text.add(text_id)
            elif keys[i] in self.seen_keys:
                keep[i] = False
                key_detail[i] = f"key {keys[i]} is already taken by a different prompt"
            else:
                self.seen_text[text_id] = keys[i]
                self.seen_keys.add(keys[i])
        table = table.set_column(table.column_names.index("key"), "key", pa.array(keys, pa.string()))
        exact = np.array([bool(d) for d in exact_detail])
        self.drop(reject_rows(table, exact, "exact_duplicate", exact_detail))
        dup_key = np.array([bool(d) for d in key_detail])
        self.drop(reject_rows(table, dup_key, "duplicate_key", key_detail))
        return table.filter(pa.array(keep)), [k for k, ok in zip(keys, keep, strict=True) if ok]

    def _token_bounds(self, table: pa.Table, keys: list[str], tokens: PromptTokens) -> tuple[pa.Table, list[str]]:
        """The rows within data.min_prompt_tokens and data.max_prompt_tokens, counted in the model's tokens."""
        cfg = self.cfg
        high = cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else float("inf")
        low, up = tokens.lengths(table.column("messages").combine_chunks(), cfg.min_prompt_tokens, high)
        short, long = up < cfg.min_prompt_tokens, low > high
        self.drop(
            reject_rows(
                table,
                short,
                "too_few_tokens",
                [f"at most {n} tokens, min_prompt_tokens={cfg.min_prompt_tokens}" for n in up],
            )
        )
        self.drop(
            reject_rows(
                table,
                long,
                "too_many_tokens",
                [f"at least {n} tokens, max_prompt_tokens={cfg.max_prompt_tokens}" for n in low],
            )
        )
        ok = ~(short | long)
        return table.filter(pa.array(ok)), [k for k, o in zip(keys, ok, strict=True) if o]

    def _near_dedup(self, table: pa.Table, keys: list[str], index: NearDuplicateIndex) -> tuple[pa.Table, list[str]]:
        """The rows that are no near duplicate (MinHash Jaccard) of a row kept before them."""
        word_lists = words(table.column("raw").combine_chunks())
        self._learn_template(word_lists)
        gram, rows = self._varying(word_lists, self.cfg.near_dup_ngram)
        found = index.check(gram, rows, table.num_rows, keys)
        near = np.array([f is not None for f in found])
        self.drop(
            reject_rows(table, near, "near_duplicate", [f"near duplicate of the kept row with key {f}" for f in found])
        )
        return table.filter(pa.array(~near)), [k for k, f in zip(keys, found, strict=True) if f is None]

    def _learn_template(self, word_lists: pa.ListArray) -> None:
        """Add to the template the n-grams that data.template_min_rows rows of this batch hold. Near-dedup streams,
        so what is template is learned batch by batch: a source of at most data.batch_rows rows is one batch (exact);
        a template spread thinner than that over a longer source is not seen, and its rows are judged whole."""
        if self.cfg.template_min_rows is None:
            return
        unique, df = document_frequency(*ngram_hashes(word_lists, self.cfg.template_ngram))
        new = unique[df >= self.cfg.template_min_rows]
        if len(new):
            self.template = sorted_unique(np.concatenate([self.template, new]))

    def _varying(self, word_lists: pa.ListArray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The n-grams of what varies in each row (`varying_words`), with the rows they belong to."""
        return varying_ngrams(word_lists, n, self.cfg.template_ngram, self.template)

    def _split(self, table: pa.Table, keys: list[str]) -> None:
        """Each row to its split by its key: val and holdout written now (their n-grams kept for the
        contamination check), train waiting for `finish`."""
        cfg = self.cfg
        split = np.array([split_of(k, cfg.holdout_share, cfg.val_share) for k in keys])
        if self.near is None:  # near-dedup learns the template where it runs
            self._learn_template(words(table.column("raw").combine_chunks()))
        for name in ("val", "holdout"):
            part = table.filter(pa.array(split == name))
            if part.num_rows:
                self._write(name, part)
                if cfg.contamination_threshold is not None:
                    self.reference_texts.write_table(part.select(["raw"]))
        train = table.filter(pa.array(split == "train"))
        if train.num_rows:
            self.pending.write_table(train)

    def _write(self, split: str, table: pa.Table) -> None:
        out = self.outputs[split]
        # Flat columns to Python, rows assembled here: Arrow's to_pylist() on nested structs costs ~5x more.
        messages = table.column("messages").combine_chunks()
        offsets = messages.offsets.to_numpy().tolist()
        flat = messages.flatten()
        roles, contents = flat.field("role").to_pylist(), flat.field("content").to_pylist()
        answers, keys = table.column("answer").to_pylist(), table.column("key").to_pylist()
        # the other columns the rewards read, beside the answer: every one on every row (null where a row has none),
        # so a reader that takes its columns from one row (the evaluation, TRL's JSON reader) sees them all
        extras = table.column("extra").to_pylist()
        carried = dict.fromkeys(self.ctx.carried)
        out.writelines(
            jsonl_line(
                {
                    "prompt": [{"role": roles[j], "content": contents[j]} for j in range(offsets[i], offsets[i + 1])],
                    "answer": answers[i],
                    "key": keys[i],
                    **carried,
                    **(orjson.loads(extras[i]) if extras[i] else {}),
                }
            )
            for i in range(len(answers))
        )
        self.kept[split] += table.num_rows

    def add_reference(self, texts: pa.Array) -> None:
        """An evaluation set's prompts, after the source's last batch: the n-grams of what varies in them, the
        source's template taken out (a benchmark that shares the source's instruction shares no item by it)."""
        gram, _ = self._varying(words(texts), self.cfg.contamination_ngram)
        self.reference.append(sorted_unique(gram))

    def finish(self) -> None:
        """Second pass: train rows against the holdout, val and evaluation n-grams, then written."""
        self.pending.close()
        self.reference_texts.close()
        with pa.OSFile(str(self.reference_path)) as source:
            for batch in pa.ipc.open_stream(source):
                gram, _ = self._varying(words(batch.column("raw")), self.cfg.contamination_ngram)
                self.reference.append(sorted_unique(gram))
        self.reference_path.unlink()
        reference = sorted_unique(np.concatenate(self.reference)) if self.reference else np.empty(0, np.uint64)
        self.reference = []
        self.outputs["train"] = (self.work / "train.jsonl").open("wb")
        cfg = self.cfg
        # Read, not memory-mapped: mapped pages would stay in this process's resident memory.
        with pa.OSFile(str(self.pending_path)) as source:
            for batch in pa.ipc.open_stream(source):
                table = pa.Table.from_batches([batch])
                if cfg.contamination_threshold is not None and len(reference):
                    gram, rows = self._varying(words(table.column("raw").combine_chunks()), cfg.contamination_ngram)
                    share = overlap_fraction(gram, rows, table.num_rows, reference)
                    dirty = share >= cfg.contamination_threshold
                    self.drop(
                        reject_rows(
                            table,
                            dirty,
                            "contaminated",
                            [
                                f"{s:.0%} of its {cfg.contamination_ngram}-grams appear in the holdout, val or eval sets"
                                f"{' (template words aside)' if len(self.template) else ''}"
                                for s in share
                            ],
                        )
                    )
                    table = table.filter(pa.array(~dirty))
                if table.num_rows:
                    self._write("train", table)
        self.pending_path.unlink()
        for f in (*self.outputs.values(), self.quarantine):
            f.close()
