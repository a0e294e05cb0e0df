"""The token store: the same ids and keys as tokenizing every prompt + completion whole, on every
data format and tokenizer; one build per key, memory-mapped after; a killed build never read, and
the chunks a stopped build tokenized taken by the next."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dpocache.data import pairs as pairs_module
from dpocache.data.keys import example_key
from dpocache.data.pairs import load_preference_data
from dpocache.data.rows import DataError, write_jsonl
from dpocache.data.token_store import STORE_DIR
from dpocache.data.tokenize import tokenize_continuations
from dpocache.models.tiny import CHAT_TEMPLATE, build_tokenizer
from dpocache.runtime.signals import NOTHING_LOST, Interrupted

REPO = Path(__file__).resolve().parents[2]
_TOOLS = [{"name": "sort_list", "description": "sort numbers", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def tokenizers_by_kind():
    """The byte-level BPE, and a SentencePiece-like one (a "▁" before every text: the cut of a
    prompt's end must not be trusted there) from test_tokenization's fixture."""
    from test_tokenization import build_sentencepiece_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{{ bos_token }}", "{{ bos_token }}{% if tools %}<|system|>tools:{% for t in tools %} {{ t['name'] }}"
        "{% endfor %}<|end|>{% endif %}")
    return {"bpe": tok, "sentencepiece": build_sentencepiece_tokenizer()}


def _rows(kind: str, make_rows, n: int = 40) -> list[dict]:
    rows = make_rows(n, seed=3, max_prompt=60)
    if kind == "text":
        return rows
    if kind == "implicit":
        return [{"chosen": r["prompt"] + " yes" + r["chosen"], "rejected": r["prompt"] + " no" + r["rejected"]}
                for r in rows]
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in rows]
    if kind == "tools":
        for i, r in enumerate(chat):
            if i % 2:
                r["tools"] = _TOOLS
    return chat


def _whole_text(monkeypatch, path, tok, **kw):
    """Today's ids: every prompt + completion tokenized whole (the rule the store must keep)."""
    with monkeypatch.context() as m:
        m.setattr(pairs_module, "continuation_ids", tokenize_continuations)
        return load_preference_data(path, tok, show_progress=False, **kw)


def _as_tuples(data):
    return [(p.index, p.prompt_ids, p.chosen_ids, p.rejected_ids, p.key, p.truncated) for p in data.pairs]


@pytest.mark.parametrize("kind", ["text", "chat", "implicit", "tools"])
@pytest.mark.parametrize("tok_name", ["bpe", "sentencepiece"])
def test_store_keeps_todays_ids_and_keys(kind, tok_name, tokenizers_by_kind, make_rows, tmp_path, monkeypatch):
    tok = tokenizers_by_kind[tok_name]
    path = write_jsonl(_rows(kind, make_rows), tmp_path / "d.jsonl")
    kw = {"max_length": 48, "max_prompt_length": 24}  # some pairs cut
    expected = _as_tuples(_whole_text(monkeypatch, path, tok, **kw))
    assert any(t[-1] for t in expected) and not all(t[-1] for t in expected)
    for (index, prompt, chosen, rejected, key, _) in expected:
        assert key == example_key(prompt, chosen, rejected)
    built = load_preference_data(path, tok, show_progress=False, cache_dir=tmp_path / "cache", **kw)
    mapped = load_preference_data(path, tok, show_progress=False, cache_dir=tmp_path / "cache", **kw)
    in_memory = load_preference_data(path, tok, show_progress=False, **kw)
    assert _as_tuples(built) == _as_tuples(mapped) == _as_tuples(in_memory) == expected
    assert isinstance(mapped.pairs.columns.ids, np.memmap)
    assert len(list((tmp_path / "cache" / STORE_DIR).iterdir())) == 2  # the store and its lock file


def _build_once(tmp_path, make_rows):
    path = write_jsonl(make_rows(30, seed=1), tmp_path / "d.jsonl")
    tok = build_tokenizer()
    cache = tmp_path / "cache"
    return path, tok, cache, load_preference_data(path, tok, show_progress=False, cache_dir=cache)


def _stores(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / STORE_DIR).iterdir() if p.is_dir())


def test_what_changes_ids_changes_the_store(tmp_path, make_rows):
    path, tok, cache, _ = _build_once(tmp_path, make_rows)
    load_preference_data(path, tok, show_progress=False, cache_dir=cache, max_length=40)
    assert len(_stores(cache)) == 2
    load_preference_data(path, tok, show_progress=False, cache_dir=cache, context=512, vocab_size=10**6)
    assert len(_stores(cache)) == 2  # the model's limits are checked after loading, not keyed
    with open(path, "a") as f:  # an edited file: a new store, the old one left in place
        f.write(json.dumps({"prompt": "one more", "chosen": " a", "rejected": " b"}) + "\n")
    data = load_preference_data(path, tok, show_progress=False, cache_dir=cache)
    assert len(data) == 31 and len(_stores(cache)) == 3


def test_a_damaged_store_is_tokenized_again(tmp_path, make_rows, capsys):
    path, tok, cache, first = _build_once(tmp_path, make_rows)
    expected = _as_tuples(first)  # before the damage, which a mapped array would show
    (store,) = _stores(cache)
    ids = store / "ids.npy"
    raw = bytearray(ids.read_bytes())
    raw[-1] ^= 0xFF
    ids.write_bytes(bytes(raw))
    again = load_preference_data(path, tok, show_progress=False, cache_dir=cache)
    assert "ids.npy does not match its checksum" in capsys.readouterr().err
    assert _as_tuples(again) == expected


def test_invalid_rows_are_stored_and_refused_without_skip_invalid(tmp_path, make_rows):
    rows = make_rows(10, seed=2)
    rows[4] = {"prompt": "p", "chosen": 5, "rejected": " x"}
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    tok, cache = build_tokenizer(), tmp_path / "cache"
    with pytest.raises(DataError, match=r"d\.jsonl:5: field 'chosen'"):
        load_preference_data(path, tok, show_progress=False, cache_dir=cache)
    assert not (cache / STORE_DIR).exists() or not _stores(cache)  # a refused set writes no store
    data = load_preference_data(path, tok, show_progress=False, cache_dir=cache, skip_invalid=True)
    assert len(data) == 9 and [str(s.location) for s in data.skipped] == [f"{path}:5"]
    moved = tmp_path / "moved.jsonl"
    path.rename(moved)  # same bytes elsewhere: the same store, locations under the new name
    with pytest.raises(DataError, match=r"moved\.jsonl:5: field 'chosen'"):
        load_preference_data(moved, tok, show_progress=False, cache_dir=cache)
    assert len(_stores(cache)) == 1


def test_pairs_the_model_cannot_take_are_named_by_line(tmp_path, make_rows):
    path, tok, cache, first = _build_once(tmp_path, make_rows)
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in first.pairs)
    victim = next(p for p in first.pairs
                  if len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) == longest)
    with pytest.raises(DataError, match=rf"d\.jsonl:{victim.index + 1}: {longest} tokens, longer than"):
        load_preference_data(path, tok, show_progress=False, cache_dir=cache, context=longest - 1)
    kept = load_preference_data(path, tok, show_progress=False, cache_dir=cache, context=longest - 1,
                                skip_invalid=True)
    assert victim.key not in {p.key for p in kept.pairs} and len(kept.skipped) >= 1
    top = max(max(p.prompt_ids + p.chosen_ids + p.rejected_ids) for p in first.pairs)
    with pytest.raises(DataError, match=f"token id {top} is outside the model's vocabulary"):
        load_preference_data(path, tok, show_progress=False, cache_dir=cache, vocab_size=top)


_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from dpocache.data import pairs, token_store
    from dpocache.models.tiny import build_tokenizer
    mode, path, cache, log = sys.argv[1:5]
    real_tokenize, real_write = pairs._tokenize_source, token_store._write
    def tokenize(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        return real_tokenize(*args, **kwargs)
    def write(directory, tokens, *meta):
        real_write(directory, tokens, *meta)
        os.remove(directory / "meta.json")  # as if killed before the last file
        os.kill(os.getpid(), signal.SIGKILL)
    pairs._tokenize_source = tokenize
    if mode == "kill":
        token_store._write = write
    data = pairs.load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=cache)
    print(len(data), data.pairs[len(data) - 1].key.hex())
""")


def _child(tmp_path: Path, mode: str, path: Path, cache: Path) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(repo=str(REPO)))
    return subprocess.Popen([sys.executable, str(script), mode, str(path), str(cache), str(tmp_path / "built.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_build_killed_while_writing_is_never_read(tmp_path, make_rows):
    path = write_jsonl(make_rows(30, seed=4), tmp_path / "d.jsonl")
    cache = tmp_path / "cache"
    killed = _child(tmp_path, "kill", path, cache)
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    # the build's tokenized chunks beside it, which the next build takes
    assert sorted(p.name[:5] for p in (cache / STORE_DIR).iterdir() if p.is_dir()) == [".part", ".tmp-"]
    expected = load_preference_data(path, build_tokenizer(), show_progress=False)
    again = _child(tmp_path, "load", path, cache)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert out.split() == [str(len(expected)), expected.pairs[len(expected) - 1].key.hex()]
    assert len((tmp_path / "built.log").read_text().split()) == 2  # the killed build, then a whole new one
    assert [p.name[:5] for p in (cache / STORE_DIR).iterdir() if p.is_dir()] != [".tmp-"]
    assert not any(p.name.startswith((".tmp-", ".partial-")) for p in (cache / STORE_DIR).iterdir())


def test_processes_started_together_tokenize_once(tmp_path, make_rows):
    path = write_jsonl(make_rows(400, seed=5, max_prompt=200), tmp_path / "d.jsonl")
    cache = tmp_path / "cache"
    children = [_child(tmp_path, "load", path, cache) for _ in range(3)]
    outputs = [c.communicate(timeout=180) for c in children]
    assert [c.returncode for c in children] == [0, 0, 0], [err for _, err in outputs]
    assert len({out for out, _ in outputs}) == 1
    assert len((tmp_path / "built.log").read_text().split()) == 1
    assert os.path.exists(cache / STORE_DIR)


def test_cache_info_lists_token_stores(tmp_path, make_rows, capsys):
    from dpocache.cli.entry import main

    path, _, cache, data = _build_once(tmp_path, make_rows)
    (cache / STORE_DIR / ".tmp-0123-99").mkdir()  # as a killed build leaves it
    (cache / STORE_DIR / ".partial-0123").mkdir()  # and its tokenized chunks
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    tokens = len(data.pairs.columns.ids)
    assert f"pairs {len(data)}  tokens {tokens} (prompts, chosen and rejected)  from {path}" in out
    assert "tokens/.tmp-0123-99  incomplete" in out
    assert "tokens/.partial-0123  partial (the chunks a build that stopped had tokenized" in out


def test_a_cache_dir_that_cannot_hold_a_store(tmp_path, make_rows, capsys):
    """Raised as the cache's own writes are (the command line makes it one line), except for a
    command that only reads the cache: a line, and the tokens in memory."""
    path = write_jsonl(make_rows(10, seed=6), tmp_path / "d.jsonl")
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache directory should be")
    with pytest.raises(OSError):
        load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=not_a_dir)
    data = load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=not_a_dir,
                                cache_read_only=True)
    expected = load_preference_data(path, build_tokenizer(), show_progress=False)
    assert _as_tuples(data) == _as_tuples(expected)
    assert "tokens: no token store in" in capsys.readouterr().err


def test_a_store_that_cannot_be_written_keeps_the_tokens(tmp_path, make_rows, capsys, monkeypatch):
    from dpocache.data import token_store

    def full_disk(directory, tokens, *meta):
        directory.mkdir(parents=True)
        (directory / "ids.npy").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_store, "_write", full_disk)
    path = write_jsonl(make_rows(10, seed=6), tmp_path / "d.jsonl")
    with pytest.raises(OSError, match="No space left on device"):
        load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=tmp_path / "cache")
    data = load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=tmp_path / "cache",
                                cache_read_only=True)
    assert len(data) == 10 and "No space left on device" in capsys.readouterr().err
    assert not any((tmp_path / "cache" / STORE_DIR).glob(".tmp-*")) and not _stores(tmp_path / "cache")


def test_a_store_missing_a_file_is_tokenized_again(tmp_path, make_rows, capsys):
    path, tok, cache, first = _build_once(tmp_path, make_rows)
    expected = _as_tuples(first)
    (store,) = _stores(cache)
    (store / "bounds.npy").unlink()
    again = load_preference_data(path, tok, show_progress=False, cache_dir=cache)
    assert "unreadable" in capsys.readouterr().err and _as_tuples(again) == expected
    assert (store / "bounds.npy").exists()


_TOKENIZE_CHUNK = pairs_module._tokenize_chunk


def _stop_at_chunk(monkeypatch, stop: int = 0) -> list[int]:
    """Chunks of 10 rows, the ``stop``-th tokenized raising ``Interrupted`` as SIGTERM's handler
    raises it while tokenizing (with its "nothing computed was lost", which the kept rows' line
    must replace: it did not); 0: none. Returns the list each tokenized chunk's row count goes into."""
    calls = []

    def tokenize_chunk(chunk, *args):
        if len(calls) + 1 == stop:
            raise Interrupted(signal.SIGTERM, NOTHING_LOST)
        calls.append(len(chunk))
        return _TOKENIZE_CHUNK(chunk, *args)

    monkeypatch.setattr(pairs_module, "ROWS_PER_CHUNK", 10)
    monkeypatch.setattr(pairs_module, "_tokenize_chunk", tokenize_chunk)
    return calls


def test_a_build_stopped_while_tokenizing_keeps_its_chunks_and_the_next_tokenizes_the_rest(tmp_path, make_rows,
                                                                                            monkeypatch, capsys):
    """A build stopped in its fourth chunk of 10 rows keeps the three before, and its stop says so;
    the next build, stopped in its second chunk, takes them, keeps one more and says so; the
    third tokenizes the fifth only, says so, and gives the pairs, keys and rows found unfit (one
    in a kept chunk, one in a new one) of tokenizing in memory; the chunks go once the store is
    written."""
    real_finish = pairs_module._finish_pair

    def finish(row, *args):  # rows 3 and 33 unfit, as a pair past every limit is
        if row.index in (3, 33):
            raise DataError(row.location, "prompt", "unfit here")
        return real_finish(row, *args)

    monkeypatch.setattr(pairs_module, "_finish_pair", finish)
    path = write_jsonl(make_rows(45, seed=7), tmp_path / "d.jsonl")
    tok, cache = build_tokenizer(), tmp_path / "cache"
    expected = load_preference_data(path, tok, show_progress=False, skip_invalid=True)  # in memory, no store
    calls = _stop_at_chunk(monkeypatch, stop=1)  # in the first chunk: nothing kept, and said so
    with pytest.raises(Interrupted) as stopped:
        load_preference_data(path, tok, show_progress=False, skip_invalid=True, cache_dir=cache)
    assert str(stopped.value) == ("stopped by SIGTERM: none of the 45 rows' tokens were kept yet (they are kept 10 "
                                  "rows at a time); the next build tokenizes them all")
    calls = _stop_at_chunk(monkeypatch, stop=4)
    with pytest.raises(Interrupted) as stopped:
        load_preference_data(path, tok, show_progress=False, skip_invalid=True, cache_dir=cache)
    assert calls == [10, 10, 10]
    (partial,) = [p for p in (cache / STORE_DIR).iterdir() if p.is_dir()]
    assert partial.name.startswith(".partial-") and len(list(partial.glob("*.json"))) == 3
    kept = f"rows tokenized are kept in {partial}; the next build tokenizes the rest"
    assert str(stopped.value) == f"stopped by SIGTERM: 30 of 45 {kept}"
    calls = _stop_at_chunk(monkeypatch, stop=2)
    with pytest.raises(Interrupted) as stopped:
        load_preference_data(path, tok, show_progress=False, skip_invalid=True, cache_dir=cache)
    assert calls == [10] and str(stopped.value) == f"stopped by SIGTERM: 40 of 45 {kept}"
    calls = _stop_at_chunk(monkeypatch)
    data = load_preference_data(path, tok, show_progress=True, skip_invalid=True, cache_dir=cache)
    assert calls == [5]
    err = capsys.readouterr().err
    assert "tokens: 40 of 45 rows were tokenized by a build that stopped; tokenizing the rest" in err
    assert _as_tuples(data) == _as_tuples(expected)
    assert [str(s) for s in data.skipped] == [str(s) for s in expected.skipped] == [
        f"{path}:4: field 'prompt': unfit here", f"{path}:34: field 'prompt': unfit here"]
    assert not partial.exists() and len(_stores(cache)) == 1


def test_a_damaged_chunk_is_tokenized_again(tmp_path, make_rows, monkeypatch):
    """A kept chunk whose array file is cut short, or whose list of unfit rows is not there (a
    build stopped between its two files), is tokenized again; the others are taken."""
    path = write_jsonl(make_rows(40, seed=8), tmp_path / "d.jsonl")
    tok, cache = build_tokenizer(), tmp_path / "cache"
    expected = load_preference_data(path, tok, show_progress=False)
    _stop_at_chunk(monkeypatch, stop=4)
    with pytest.raises(Interrupted):
        load_preference_data(path, tok, show_progress=False, cache_dir=cache)
    (partial,) = [p for p in (cache / STORE_DIR).iterdir() if p.is_dir()]
    first, second, _ = sorted(partial.glob("*.npz"))
    first.write_bytes(first.read_bytes()[:100])
    second.with_suffix(".json").unlink()
    calls = _stop_at_chunk(monkeypatch)
    data = load_preference_data(path, tok, show_progress=False, cache_dir=cache)
    assert calls == [10, 10, 10]  # the first two again, and the fourth
    assert _as_tuples(data) == _as_tuples(expected)


def test_chunks_that_cannot_be_kept_leave_the_build_as_it_was(tmp_path, make_rows, monkeypatch, capsys):
    """A chunk whose file cannot be written (a full disk that frees up later) is not kept, says
    nothing (the store's own write names a disk that stays full), and the store is written."""
    from dpocache.data import token_store

    def full(path, write):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_store, "_write_whole", full)
    _stop_at_chunk(monkeypatch)
    path = write_jsonl(make_rows(25, seed=9), tmp_path / "d.jsonl")
    data = load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=tmp_path / "cache")
    assert _as_tuples(data) == _as_tuples(load_preference_data(path, build_tokenizer(), show_progress=False))
    assert len(_stores(tmp_path / "cache")) == 1 and capsys.readouterr().err == ""


def test_long_data_shows_a_bar_while_its_rows_are_checked_and_one_while_they_are_tokenized(tmp_path, make_rows,
                                                                                           monkeypatch, capsys):
    """Checking and rendering every row (a chat template's, the slower half on conversation
    rows) came before the tokenizing bar, in silence: 19 s for 50,000 chat rows in a trial."""
    monkeypatch.setattr(pairs_module, "ROWS_PER_CHUNK", 10)  # "long": a chunk or more
    path = write_jsonl(make_rows(45, seed=3), tmp_path / "d.jsonl")
    load_preference_data(path, build_tokenizer(), show_progress=True)
    err = capsys.readouterr().err
    assert "checking rows: 100%" in err and "45/45" in err and err.index("checking rows") < err.index("tokenizing")
    load_preference_data(write_jsonl(make_rows(9), tmp_path / "short.jsonl"), build_tokenizer(), show_progress=True)
    assert "checking rows" not in capsys.readouterr().err  # shorter than a chunk: no bar


def test_data_tokenized_again_says_why(tmp_path, make_rows, capsys):
    """Another --max-length, or an edited file, tokenizes the whole set again (34 s at 100,000
    rows in a trial) where a store of it is in the cache: said, with what changed."""
    path, cache, tok = write_jsonl(make_rows(12), tmp_path / "d.jsonl"), tmp_path / "cache", build_tokenizer()
    load_preference_data(path, tok, max_length=256, show_progress=True, cache_dir=cache)
    assert "tokenized again" not in capsys.readouterr().err  # the first store of it
    load_preference_data(path, tok, max_length=128, show_progress=True, cache_dir=cache)
    assert (f"tokens: {path} is tokenized again for max_length 128 (the cache has 256); the other store stays"
            in capsys.readouterr().err)
    write_jsonl(make_rows(13), path)
    load_preference_data(path, tok, max_length=128, show_progress=True, cache_dir=cache)
    assert (f"tokens: {path} is tokenized again: the file, or the tokenizer, is not the one its other store here "
            "was made from (that store stays, for runs of those)" in capsys.readouterr().err)
    load_preference_data(path, tok, max_length=128, show_progress=True, cache_dir=cache)
    assert "tokens:" not in capsys.readouterr().err  # read from its store
    store = next(p for p in (cache / STORE_DIR).iterdir() if (p / "meta.json").exists()
                 and json.loads((p / "meta.json").read_text())["pairs"] == 13)
    (store / "ids.npy").write_bytes(b"damaged")
    load_preference_data(path, tok, max_length=128, show_progress=True, cache_dir=cache)
    err = capsys.readouterr().err  # the damage said, and nothing said of a file changed
    assert "does not match its checksum" in err or "tokenizing again" in err, err
    assert "is not the one its other store" not in err, err


def test_a_full_disk_under_numpy_says_so_by_file(tmp_path, make_rows, monkeypatch):
    """numpy's short write ("67471 requested and 35808 written", no errno) was a traceback."""
    import errno

    def short_write(file, array, allow_pickle=False):
        raise OSError("67471 requested and 35808 written")

    monkeypatch.setattr(np, "save", short_write)
    path = write_jsonl(make_rows(10, seed=6), tmp_path / "d.jsonl")
    with pytest.raises(OSError) as full:
        load_preference_data(path, build_tokenizer(), show_progress=False, cache_dir=tmp_path / "cache")
    assert full.value.errno == errno.ENOSPC and full.value.filename.endswith(".npy")
