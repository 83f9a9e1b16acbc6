"""Text measures for the data stage, computed on whole Arrow batches: normalized text, word n-gram
hashes, what varies between rows (their words with the template's taken out), prompt length in the model's own
tokens, and a MinHash LSH index for near duplicates.

Words are maximal runs of letters and digits, or single punctuation marks (so '3 + 4' and '3 - 4' stay
different), lower-cased. N-gram hashes are 64-bit, computed with numpy over every row of a batch at once;
a row with fewer words than n counts as one n-gram of all its words.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

_PUNCT = r"([^\p{L}\p{N}\s\p{Z}])"
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: n-gram hashes are a polynomial in this base, mod 2^64
LSH_WEIGHTS = (0.01, 0.99)  # near-dedup's LSH: (false positive, false negative) weights; see NearDuplicateIndex


def normalize(texts: pa.Array) -> pa.Array:
    """Lower case, runs of whitespace as one space, trimmed: what exact dedup compares.

    >>> normalize(pa.array(["  What IS\\n3 +  4? ", ""])).to_pylist()
    ['what is 3 + 4?', '']
    """
    # Splitting on Unicode whitespace and joining is ~3x faster than a whitespace regex in Arrow.
    return pc.binary_join(pc.utf8_split_whitespace(pc.utf8_trim_whitespace(pc.utf8_lower(texts))), " ")


def words(texts: pa.Array) -> pa.ListArray:
    """Each text's words: letter/digit runs and single punctuation marks, lower-cased.

    >>> words(pa.array(["What is 3+4?", "", " a\\u00a0b "])).to_pylist()
    [['what', 'is', '3', '+', '4', '?'], [], ['a', 'b']]
    """
    spaced = pc.replace_substring_regex(pc.utf8_lower(texts), _PUNCT, r" \1 ")
    split = pc.utf8_split_whitespace(pc.utf8_trim_whitespace(spaced))
    # An empty text splits into [""]: make it no words.
    lengths = pc.list_value_length(split).to_numpy(zero_copy_only=False)
    flat = split.flatten()
    keep = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
    if keep.all():
        return split
    row_of = np.repeat(np.arange(len(split)), lengths)
    kept_lengths = np.bincount(row_of[keep], minlength=len(split))
    offsets = np.concatenate([[0], np.cumsum(kept_lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), flat.filter(pa.array(keep)))


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy 2's hash-based unique is ~100x slower on random 64-bit hashes).

    >>> sorted_unique(np.array([3, 1, 3, 2], np.uint64)).tolist()
    [1, 2, 3]
    """
    s = np.sort(values)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def token_hashes(word_lists: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """A 64-bit hash per word (all rows' words in order) and each row's number of words.

    >>> h, lengths = token_hashes(words(pa.array(["a b a", "", "b"])))
    >>> lengths.tolist(), bool(h[0] == h[2]), bool(h[1] == h[3])
    ([3, 0, 1], True, True)
    """
    lengths = pc.list_value_length(word_lists).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = word_lists.flatten()
    if len(flat) == 0:
        return np.empty(0, np.uint64), lengths
    # Hash each distinct word once (pandas' SipHash with its fixed key: the same on every run).
    encoded = pc.dictionary_encode(flat)
    word_hash = pd.util.hash_array(encoded.dictionary.to_numpy(zero_copy_only=False), categorize=False)
    return word_hash[encoded.indices.to_numpy(zero_copy_only=False)], lengths


def _windows(h: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hashes of the full n-word windows of every row, their first word's index into `h`, and each word's row."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(h)) - starts[row_of]
    with np.errstate(over="ignore"):
        full = np.zeros(max(len(h) - n + 1, 0), np.uint64)
        for k in range(n):
            full = full * _MULT + h[k : k + len(full)]
    # Full n-grams: windows that start at pos <= length - n of their row.
    first = np.flatnonzero(pos[: len(full)] + n <= lengths[row_of[: len(full)]])
    return full[first], first, row_of


def hashed_ngrams(h: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`ngram_hashes` over words already hashed (`token_hashes`, `varying_words`)."""
    if len(h) == 0:
        return np.empty(0, np.uint64), np.empty(0, np.int64)
    full, first, row_of = _windows(h, lengths, n)
    grams, gram_rows = [full], [row_of[first]]
    # Short rows (0 < length < n): one gram of all their words, salted by the length.
    short = np.flatnonzero((lengths > 0) & (lengths < n))
    if len(short):
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        acc = np.zeros(len(short), np.uint64)
        with np.errstate(over="ignore"):
            for k in range(int(lengths[short].max())):
                live = k < lengths[short]
                acc[live] = acc[live] * _MULT + h[starts[short][live] + k]
        grams.append(acc ^ lengths[short].astype(np.uint64))
        gram_rows.append(short)
    gram, rows = np.concatenate(grams), np.concatenate(gram_rows)
    order = np.argsort(rows, kind="stable")
    return gram[order], rows[order]


def ngram_hashes(word_lists: pa.ListArray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every word n-gram, and the row each belongs to (rows in order).

    >>> h, rows = ngram_hashes(words(pa.array(["a b c d", "a b c", "x"])), 3)
    >>> rows.tolist(), bool(h[1] == h[2]), bool(h[0] == h[2])
    ([0, 0, 1, 2], False, True)
    """
    return hashed_ngrams(*token_hashes(word_lists), n)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a non-linear 64-bit mix."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def varying_words(h: np.ndarray, lengths: np.ndarray, k: int, template: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's words (hashed, as `token_hashes` gives them) with what it shares with many rows taken out: a word
    inside a k-word window whose hash is in `template` (sorted) is template, and each run of template words becomes
    one word, a hash of the run's words. What is left is what varies, in order, with the template's place kept:
    two rows of one template differ there only, and the same numbers in another template still differ.

    >>> h, lengths = token_hashes(words(pa.array(["we have 3 red apples and 4 green pears", "we have 5 red apples"])))
    >>> fixed, _ = ngram_hashes(words(pa.array(["have 3 red apples and", "red apples and 4 green"])), 2)
    >>> v, n = varying_words(h, lengths, 2, np.sort(fixed[[2, 3]]))  # 'red apples', 'apples and': template
    >>> n.tolist()  # 'we have 3 <red apples and> 4 green pears', 'we have 5 <red apples>'
    [7, 4]
    >>> bool(v[2] == h[2]), bool(v[4] == h[6]), bool(v[3] == h[3]), bool(v[3] == v[10])
    (True, True, False, False)
    """
    if not len(template) or not len(h):
        return h, lengths
    full, first, row_of = _windows(h, lengths, k)
    hit = np.zeros(len(h) + 1, np.int64)
    hit[first[found_in(full, template)]] = 1
    # A word is covered when a template window starts at most k - 1 words before it (a window never crosses rows).
    covered_starts = np.concatenate([[0], np.cumsum(hit[:-1])])
    index = np.arange(len(h))
    covered = covered_starts[index + 1] - covered_starts[np.maximum(index - k + 1, 0)] > 0
    row_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    at_start = np.zeros(len(h), bool)
    at_start[row_start[lengths > 0]] = True
    run_start = covered & (at_start | ~np.concatenate([[False], covered[:-1]]))
    runs = np.flatnonzero(run_start[covered])
    out = h.copy()
    if len(runs):
        # Order-free (a sum), then mixed: n-gram hashes are linear in their words' hashes, and a linear marker
        # would let 'a <run holding b>' and 'b <run holding a>' hash alike.
        out[run_start] = _mix(np.add.reduceat(h[covered], runs))
    keep = ~covered | run_start
    return out[keep], np.bincount(row_of[keep], minlength=len(lengths)).astype(np.int64)


def varying_ngrams(word_lists: pa.ListArray, n: int, k: int, template: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ngram_hashes` of each row's `varying_words`: the n-grams of what varies between rows.

    >>> texts = pa.array([f"Multiply {a} by {b} and write the product as a whole number, please." for a, b in
    ...                   [(3, 4), (3, 5), (6, 4)]])
    >>> template, _ = ngram_hashes(words(pa.array(["and write the product as a whole number , please ."])), 3)
    >>> g, rows = varying_ngrams(words(texts), 3, 3, np.sort(template))
    >>> rows.tolist()  # each row 'multiply a by b <the template>': 5 words, 3 trigrams
    [0, 0, 0, 1, 1, 1, 2, 2, 2]
    >>> [len(set(g[rows == 0]) & set(g[rows == r])) for r in (1, 2)]  # 'multiply 3 by'; 'by 4 <template>'
    [1, 1]
    """
    return hashed_ngrams(*varying_words(*token_hashes(word_lists), k, template), n)


def document_frequency(gram: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct n-gram hashes of a batch, sorted, and in how many rows each occurs (a row counts once).

    >>> u, df = document_frequency(np.array([7, 7, 8, 7, 9], np.uint64), np.array([0, 0, 0, 1, 2]))
    >>> u.tolist(), df.tolist()
    ([7, 8, 9], [2, 1, 1])
    """
    if not len(gram):
        return gram, np.zeros(0, np.int64)
    # One (row, gram) pair per row: a sort by gram then row puts a row's repeats side by side.
    order = np.lexsort((rows, gram))
    g, r = gram[order], rows[order]
    g = g[np.concatenate(([True], (g[1:] != g[:-1]) | (r[1:] != r[:-1])))]
    first = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
    return g[first], np.diff(np.append(first, len(g)))


def found_in(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Which values occur in `reference`, a sorted array (np.isin by binary search: no hash table).

    >>> found_in(np.array([3, 1, 4], np.uint64), np.array([1, 2, 3], np.uint64)).tolist()
    [True, True, False]
    """
    if len(reference) == 0 or len(values) == 0:
        return np.zeros(len(values), bool)
    order = np.argsort(values)  # sorted queries walk the reference in order: ~4x faster than random probes
    idx = np.searchsorted(reference, values[order]).clip(max=len(reference) - 1)
    hit = np.empty(len(values), bool)
    hit[order] = reference[idx] == values[order]
    return hit


def overlap_fraction(gram: np.ndarray, rows: np.ndarray, n_rows: int, reference: np.ndarray) -> np.ndarray:
    """Per row, the share of its n-grams found in `reference` (a sorted array of n-gram hashes).

    >>> overlap_fraction(np.array([1, 2, 3, 9], np.uint64), np.array([0, 0, 1, 1]), 3, np.array([2, 9], np.uint64))
    array([0.5, 0.5, 0. ])
    """
    if len(reference) == 0 or len(gram) == 0:
        return np.zeros(n_rows)
    hit = found_in(gram, reference)
    total = np.bincount(rows, minlength=n_rows)
    return np.divide(np.bincount(rows, weights=hit, minlength=n_rows), total, out=np.zeros(n_rows), where=total > 0)


def _band_key(band: bytes) -> bytes:
    return hashlib.blake2b(band, digest_size=8).digest()


class NearDuplicateIndex:
    """MinHash LSH (datasketch) over word-n-gram sets: `check` says, row by row in order, which earlier
    kept row a row nearly duplicates, and remembers the rows that are kept.

    LSH candidates are confirmed with the MinHash Jaccard estimate against the stored signature, so a row
    is dropped only when its estimated similarity reaches the threshold.
    """

    def __init__(self, threshold: float, num_perm: int, seed: int = 1):
        from datasketch import MinHash, MinHashLSH

        self.threshold = threshold
        # LSH only proposes candidates; each is confirmed against its stored signature below, so a false
        # positive costs one comparison while a false negative lets a near duplicate through (and later drops
        # its original as contaminated when the copy lands in val or holdout). datasketch's default weights
        # (0.5, 0.5) chose 9 bands of 13 rows at 0.8: 60 % of pairs at Jaccard 0.8 and 7 % at 0.9 were never
        # proposed. Weighting misses 99:1 gives 18 bands of 7 at 0.8: 1.5 % missed at 0.8, 0.1 % at 0.85.
        # Band keys hashed to 8 bytes instead of r * 4 bytes keep the extra bands' memory small.
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS, hashfunc=_band_key)
        self._template = MinHash(num_perm=num_perm, seed=seed, hashfunc=int)
        self._signatures = np.empty((1024, num_perm), np.uint32)
        self.labels: list[str] = []

    def __len__(self) -> int:
        return len(self.labels)

    def check(
        self, gram: np.ndarray, rows: np.ndarray, n_rows: int, labels: Sequence[str], keep: np.ndarray | None = None
    ) -> list[str | None]:
        """For each row: the label of the kept row it nearly duplicates, or None (and it is kept).

        Rows with `keep[i] == False` are skipped (already dropped by an earlier check).
        """
        found: list[str | None] = [None] * n_rows
        bounds = np.searchsorted(rows, np.arange(n_rows + 1))
        hashes32 = (gram >> np.uint64(32)).astype(np.uint32)  # datasketch's default scheme takes 32-bit input
        for i in range(n_rows):
            if keep is not None and not keep[i]:
                continue
            part = hashes32[bounds[i] : bounds[i + 1]]
            if not len(part):
                continue
            m = self._template.copy()
            m.update_batch(part.tolist())
            for candidate in self.lsh.query(m):
                if np.mean(self._signatures[candidate] == m.hashvalues) >= self.threshold:
                    found[i] = self.labels[candidate]
                    break
            if found[i] is None:
                slot = len(self.labels)
                if slot == len(self._signatures):
                    self._signatures = np.concatenate([self._signatures, np.empty_like(self._signatures)])
                self._signatures[slot] = m.hashvalues
                self.lsh.insert(slot, m, check_duplication=False)
                self.labels.append(labels[i])
        return found


class PromptTokens:
    """Prompt length in the model's own tokens, chat template included.

    length = tokens of the template rendered with empty contents (once per sequence of roles)
           + the tokens of each message's content.
    This equals tokenizing the rendered prompt whenever the template sets contents apart with special
    tokens or newlines (ChatML, Llama, Qwen, SmolLM templates do).

    For byte-level BPE tokenizers without a normalizer, a content of b UTF-8 bytes has between
    ceil(b / longest token) and b tokens; rows whose bounds already decide the length filter are not
    tokenized at all (`exact` counts the rows that were).
    """

    def __init__(self, tokenizer_path: str | Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        self._overhead: dict[tuple[str, ...], int] = {}
        self.backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self.byte_level, self.longest = self._byte_bounds()
        self.exact = 0

    def _byte_bounds(self) -> tuple[bool, int]:
        backend = self.backend
        if backend is None or type(backend.model).__name__ != "BPE":
            return False, 0
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer else None
        no_normalizer = normalizer is None or (normalizer.get("type") == "Sequence" and not normalizer["normalizers"])
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else {}
        pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        byte_level = any(p.get("type") == "ByteLevel" and not p.get("add_prefix_space") for p in pres)
        if not (no_normalizer and byte_level):
            return False, 0
        # Byte-level vocabularies spell each byte as one character, so a token's length is its byte count;
        # added tokens are plain text, counted by their UTF-8 length (the larger of the two is safe).
        return True, max(max(len(t), len(t.encode())) for t in backend.get_vocab(with_added_tokens=True))

    def overhead(self, roles: tuple[str, ...]) -> int:
        if roles not in self._overhead:
            if self.tokenizer.chat_template:
                rendered = self.tokenizer.apply_chat_template(
                    [{"role": r, "content": ""} for r in roles], tokenize=False, add_generation_prompt=True
                )
                self._overhead[roles] = len(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
            else:
                self._overhead[roles] = 0
        return self._overhead[roles]

    def count(self, texts: list[str]) -> np.ndarray:
        if self.backend is not None:
            encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
            return np.fromiter((len(e) for e in encodings), np.int64, len(texts))
        return np.array([len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]], np.int64)

    def lengths(self, messages: pa.ListArray, low: int, high: float) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) bounds of each row's prompt tokens; equal where counted exactly.

        Rows whose bounds straddle [low, high] are counted exactly; the others keep their bounds.
        """
        n = len(messages)
        lengths = pc.list_value_length(messages).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = messages.flatten()
        roles = flat.field("role").to_pylist()
        contents = flat.field("content")
        row_of = np.repeat(np.arange(n), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        base = np.array([self.overhead(tuple(roles[starts[i] : starts[i + 1]])) for i in range(n)], np.int64)
        if self.byte_level:
            nbytes = pc.binary_length(contents).to_numpy(zero_copy_only=False).astype(np.int64)
            lower = base + np.bincount(row_of, weights=-(-nbytes // self.longest), minlength=n).astype(np.int64)
            upper = base + np.bincount(row_of, weights=nbytes, minlength=n).astype(np.int64)
            undecided = ~((lower >= low) & (upper <= high)) & ~((upper < low) | (lower > high))
        else:
            lower, upper = base.copy(), base.copy()
            undecided = np.ones(n, bool)
        if undecided.any():
            rows = np.flatnonzero(undecided)
            pick = np.isin(row_of, rows)
            # Distinct contents once: a shared system prompt is tokenized a single time per batch.
            encoded = pc.dictionary_encode(contents.filter(pa.array(pick)))
            per_unique = self.count(encoded.dictionary.to_pylist())
            per_message = per_unique[encoded.indices.to_numpy(zero_copy_only=False)]
            exact = base + np.bincount(row_of[pick], weights=per_message, minlength=n).astype(np.int64)
            lower[rows] = exact[rows]
            upper[rows] = exact[rows]
            self.exact += len(rows)
        return lower, upper
