"""Token ids of prompts and of their completions as they continue them, tokenizing each prompt once.

The rule (``tokenize_continuations``): a completion's ids are those that follow the prompt's own
ids when prompt + completion is tokenized as one text, the ids the model reads and TRL 1.16's;
where tokens merge across the boundary, the completion is tokenized alone. Tokenizing every
prompt + completion whole reads each prompt three times (alone, then before each completion),
and prompts are most of a preference set's text.

``continuation_ids`` gives the same ids with each prompt tokenized once. A fast tokenizer splits
a text into pieces (its pre-tokenizer: words with their leading space, runs of punctuation or
digits) and encodes each piece on its own, so the ids of a text from a piece's start on are those
of that suffix tokenized alone. A row's prompt is cut at a piece start a few pieces before its end
(``TAIL_PIECES``, from the prompt's own encoding), and only that tail is tokenized again before
each completion. Whether the cut holds is checked per row (the tail alone must give the prompt's
last ids), and on a sample of rows against the whole texts: a tokenizer for which it fails (a
normalizer that prepends to every text, a pre-tokenizer that looks behind) is tokenized whole.
"""

from __future__ import annotations

import random
from typing import Sequence

from tqdm.auto import tqdm

TAIL_PIECES = 4  # pieces of the prompt re-read before each completion: margin for look-ahead at the prompt's end
CHECKED_ROWS = 64  # rows also tokenized whole, to confirm the cut on this tokenizer and data
CHUNK = 2048  # texts per call: the fast tokenizer parallelises each call over every core


def _encode(tokenizer, texts: list[str], desc: str, show_progress: bool):
    """Encodings of ``texts`` without special tokens, chunked for the bar. With ``encodings`` a
    fast tokenizer's pieces come too; a slow tokenizer gives ids only."""
    out = []
    for start in tqdm(range(0, len(texts), CHUNK), desc=desc, disable=not show_progress or len(texts) < 4 * CHUNK,
                      unit_scale=CHUNK, unit="rows"):
        batch = tokenizer(texts[start:start + CHUNK], add_special_tokens=False)
        out.extend(batch.encodings if batch.encodings is not None else batch["input_ids"])
    return out


def _clean_backend(tokenizer):
    """The fast backend when it is set as ``tokenizer(...)`` leaves it (no truncation or padding,
    its special-token splitting), so that calling it directly gives the same ids; else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is None or not hasattr(backend, "encode_batch_fast") or backend.truncation is not None
            or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))):
        return None
    return backend


def _encode_pieces(tokenizer, texts: list[str]) -> list:
    """Encodings of ``texts`` with their pieces (``word_ids``), straight from the fast backend
    when it can be called directly (transformers' per-row conversion is a tenth of the time)."""
    backend = _clean_backend(tokenizer)
    if backend is None:
        return _encode(tokenizer, texts, "", False)
    return [e for start in range(0, len(texts), CHUNK)
            for e in backend.encode_batch(texts[start:start + CHUNK], add_special_tokens=False)]


def _encode_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Ids of ``texts`` without special tokens, by the fast backend's ``encode_batch_fast`` (no
    offsets: a tenth faster) where it can be called directly; else through ``tokenizer(...)``."""
    backend = _clean_backend(tokenizer)
    if backend is None:
        return [_ids(e) for e in _encode(tokenizer, texts, "", False)]
    return [e.ids for start in range(0, len(texts), CHUNK)
            for e in backend.encode_batch_fast(texts[start:start + CHUNK], add_special_tokens=False)]


def _ids(encoded) -> list[int]:
    return encoded if isinstance(encoded, list) else encoded.ids


def tokenize_continuations(tokenizer, prompts: list[str], completions: list[list[str]],
                           show_progress: bool = False) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Ids of each prompt, and of each of its completions as it continues that prompt (the module's
    rule), tokenizing prompt + completion whole; no special tokens are added. The reference that
    ``continuation_ids`` is checked against, and the way for tokenizers without pieces.

    A SentencePiece tokenizer that puts "▁" before every text (Llama 2's, Mistral v0.1's) makes
    " blue" "▁", "▁blue" alone where the whole text has "▁blue": hence the whole text."""
    prompt_ids = [_ids(e) for e in _encode(tokenizer, prompts, "tokenizing prompts", show_progress)]
    owners = [(i, k) for i, texts in enumerate(completions) for k in range(len(texts))]
    whole = _encode(tokenizer, [prompts[i] + completions[i][k] for i, k in owners],
                    "tokenizing prompt + completion", show_progress)
    tails = [(prompt_ids[i], 0, _ids(w)) for (i, _), w in zip(owners, whole)]
    return prompt_ids, _completions(tokenizer, completions, owners, tails, show_progress)


def _completions(tokenizer, completions: list[list[str]], owners: list[tuple[int, int]],
                 tails: list[tuple[list[int], int, list[int]]], show_progress: bool) -> list[list[list[int]]]:
    """Each completion's ids from (prompt ids, ids before the tail, ids of tail + completion); a
    completion whose first ids merge with the prompt's is tokenized alone."""
    out: list[list[list[int]]] = [[[] for _ in texts] for texts in completions]
    merged = []
    for (i, k), (prompt, cut, ids) in zip(owners, tails):
        n = len(prompt) - cut
        if ids[:n] == prompt[cut:]:
            out[i][k] = ids[n:]
        else:
            merged.append((i, k))
    alone = _encode(tokenizer, [completions[i][k] for i, k in merged], "tokenizing completions", show_progress)
    for (i, k), ids in zip(merged, alone):
        out[i][k] = _ids(ids)
    return out


def tail_start(encoding, pieces: int = TAIL_PIECES) -> tuple[int, int]:
    """(token, character) where the prompt's last ``pieces`` + 1 pieces begin; (0, 0) for a
    prompt with fewer. A piece starts at a token whose word index differs from the one before.
    Read from the end a token at a time (the whole ``word_ids`` list costs a list per prompt)."""
    seen = 0
    word = encoding.token_to_word(len(encoding) - 1) if len(encoding) else None
    for j in range(len(encoding) - 1, 0, -1):
        before = encoding.token_to_word(j - 1)
        if word is not None and word != before:
            seen += 1
            if seen > pieces:
                return j, encoding.token_to_chars(j)[0]
        word = before
    return 0, 0


def continuation_ids(tokenizer, prompts: list[str], completions: list[list[str]],
                     show_progress: bool = False) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``tokenize_continuations``' ids, each prompt tokenized once (see the module docstring)."""
    if prompts:  # tokenizer(...) sets the backend for plain encoding (no truncation, no padding) as it goes
        _encode(tokenizer, prompts[:1], "", False)
    encodings = _encode_pieces(tokenizer, prompts)
    if not encodings or isinstance(encodings[0], list):  # a slow tokenizer: no pieces to cut at
        return tokenize_continuations(tokenizer, prompts, completions, show_progress)
    prompt_ids = [e.ids for e in encodings]
    cuts = [tail_start(e) for e in encodings]
    tail_texts = [p[c:] for p, (_, c) in zip(prompts, cuts)]
    tail_alone = _encode_ids(tokenizer, tail_texts)
    # A cut the tail alone does not reproduce (a normalizer or pre-tokenizer that treats a text's
    # start apart) falls back to the whole prompt for that row.
    cuts = [(j, c) if ids == prompt_ids[i][j:] else (0, 0)
            for i, (ids, (j, c)) in enumerate(zip(tail_alone, cuts))]
    owners = [(i, k) for i, texts in enumerate(completions) for k in range(len(texts))]
    joined = _encode_ids(tokenizer, [prompts[i][cuts[i][1]:] + completions[i][k] for i, k in owners])
    tails = [(prompt_ids[i], cuts[i][0], ids) for (i, _), ids in zip(owners, joined)]
    result = _completions(tokenizer, completions, owners, tails, show_progress)
    if not _agrees(tokenizer, prompts, completions, result):
        return tokenize_continuations(tokenizer, prompts, completions, show_progress)
    return prompt_ids, result


def _agrees(tokenizer, prompts: Sequence[str], completions: Sequence[list[str]],
            result: list[list[list[int]]]) -> bool:
    """Whether a sample of rows, tokenized whole, gives the same completion ids."""
    rows = sorted(random.Random(0).sample(range(len(prompts)), min(CHECKED_ROWS, len(prompts))))
    _, whole = tokenize_continuations(tokenizer, [prompts[i] for i in rows], [completions[i] for i in rows])
    return all(whole[n] == result[i] for n, i in enumerate(rows))
