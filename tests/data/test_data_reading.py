"""Reading preference data: column mapping, rows that cannot be read (bytes, JSON), skipping them,
and the counts the summaries print."""

from __future__ import annotations

import json
import re

import pytest

from dpocache.data.pairs import load_preference_data
from dpocache.data.rows import DataError, write_jsonl


def _load(source, tokenizer, **kw):
    return load_preference_data(source, tokenizer, show_progress=False, **kw)


def _keys(data):
    return [p.key for p in data.pairs]


def test_question_column_is_named_not_read_as_implicit_prompt(tmp_path, tokenizer, pref_rows):
    """Today such rows were read as implicit-prompt data (chosen and rejected share a prefix
    here) and the question was dropped without a word."""
    rows = [{"question": r["prompt"], "chosen": " the answer is" + r["chosen"], "rejected": " the answer is" +
             r["rejected"]} for r in pref_rows[:4]]
    path = write_jsonl(rows, tmp_path / "q.jsonl")
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    msg = str(err.value)
    assert f"{path}:1" in msg and "field 'prompt': missing" in msg and "--data.prompt_field question" in msg, msg


def test_column_mapping_gives_the_standard_rows_keys(tmp_path, tokenizer, pref_rows):
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "id": i}
               for i, r in enumerate(pref_rows)]
    path = write_jsonl(renamed, tmp_path / "renamed.jsonl")
    mapped = _load(path, tokenizer, columns=("question", "good", "bad"))
    assert _keys(mapped) == _keys(_load(pref_rows, tokenizer))


def test_missing_mapped_column_is_named(tmp_path, tokenizer, pref_rows):
    path = write_jsonl(pref_rows[:3], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=rf"{path}:1: field 'good': missing.*--data\.chosen_field"):
        _load(path, tokenizer, columns=("prompt", "good", "rejected"))


def test_every_missing_field_is_named_at_once_with_the_flags_to_pass(tmp_path, tokenizer, pref_rows):
    """A question/good/bad data set took three runs, one field at a time; the flags the one error
    gives now load it."""
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "id": i}
               for i, r in enumerate(pref_rows)]
    path = write_jsonl(renamed, tmp_path / "qgb.jsonl")
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: fields 'prompt', 'chosen', 'rejected' missing; the row has columns 'question', "
                          "'good', 'bad', 'id': pass --data.prompt_field question --data.chosen_field good "
                          "--data.rejected_field bad (guessed from the file's column order: check it, above all "
                          "that 'good' is the preferred completion)"), msg
    flags = dict(re.findall(r"--data\.(\w+)_field (\w+)", msg))
    mapped = _load(path, tokenizer, columns=(flags["prompt"], flags["chosen"], flags["rejected"]))
    assert _keys(mapped) == _keys(_load(pref_rows, tokenizer))


def test_completions_under_other_names_without_a_prompt_column_are_implicit_prompt(tokenizer):
    rows = [{"good": "sort 3 1: 1 3", "bad": "sort 3 1: 3 1"}]
    with pytest.raises(DataError) as err:
        _load(rows, tokenizer)
    assert "fields 'chosen', 'rejected' missing; the row has columns 'good', 'bad': pass --data.chosen_field good " \
           "--data.rejected_field bad (" in str(err.value), err.value
    implicit = _load(rows, tokenizer, columns=("prompt", "good", "bad"))
    assert _keys(implicit) == _keys(_load([{"chosen": rows[0]["good"], "rejected": rows[0]["bad"]}], tokenizer))


def test_columns_that_do_not_decide_the_mapping_get_placeholders(tokenizer):
    rows = [{"question": "sort 3 1:", "good": " 1 3", "bad": " 3 1", "note": "synthetic"}]
    with pytest.raises(DataError) as err:
        _load(rows, tokenizer)
    assert str(err.value).endswith("fields 'prompt', 'chosen', 'rejected' missing; the row has columns 'question', "
                                   "'good', 'bad', 'note': pass --data.prompt_field COLUMN --data.chosen_field COLUMN "
                                   "--data.rejected_field COLUMN"), err.value


def test_a_mapped_column_that_is_missing_too_is_named_with_the_others(tmp_path, tokenizer, pref_rows):
    path = write_jsonl([{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in pref_rows[:2]],
                       tmp_path / "d.jsonl")
    with pytest.raises(DataError) as err:
        _load(path, tokenizer, columns=("question", "preferred", "dispreferred"))
    assert f"{path}:1: fields 'preferred', 'dispreferred' missing; the row has columns 'question', 'good', 'bad': " \
           "pass --data.chosen_field good --data.rejected_field bad" in str(err.value), err.value


def test_prompt_column_none_reads_implicit_prompts(tokenizer):
    rows = [{"chosen": "sort 3 1: 1 3", "rejected": "sort 3 1: 3 1", "source": "synthetic"}]
    with pytest.raises(DataError, match="--data.prompt_field source"):
        _load(rows, tokenizer)  # another text column: maybe the prompt under another name
    implicit = _load(rows, tokenizer, columns=(None, "chosen", "rejected"))
    assert _keys(implicit) == _keys(_load([{k: v for k, v in rows[0].items() if k != "source"}], tokenizer))


UNREADABLE = {
    "malformed JSON": b'{"prompt": "x", "chosen": \n',
    "not UTF-8": b'{"prompt": "caf\xe9", "chosen": " a", "rejected": " b"}\n',
    "lone surrogate": b'{"prompt": "x \\udc00", "chosen": " a", "rejected": " b"}\n',
    "nested 200,000 deep": b"[" * 200_000 + b"]" * 200_000 + b"\n",
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_line_is_a_row_error_that_skip_invalid_skips(tmp_path, tokenizer, pref_rows, case):
    good = [json.dumps(r).encode() + b"\n" for r in pref_rows[:3]]
    path = tmp_path / "d.jsonl"
    path.write_bytes(good[0] + UNREADABLE[case] + good[1] + good[2])
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    assert str(err.value).startswith(f"{path}:2: "), err.value
    data = _load(path, tokenizer, skip_invalid=True)
    assert [p.index for p in data.pairs] == [0, 2, 3]
    assert [s.location for s in data.skipped] == [f"{path}:2"]
    assert _keys(data) == _keys(_load(pref_rows[:3], tokenizer))


def test_a_raw_tab_in_a_string_says_what_to_write(tmp_path, tokenizer, pref_rows):
    """json's "Invalid control character at" read "malformed JSON (Invalid control character at at
    column N)": neither what it is nor what to do."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(pref_rows[0]).encode() + b'\n{"prompt": "a\tb", "chosen": " x", "rejected": " y"}\n')
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    assert str(err.value) == (f"{path}:2: malformed JSON (a raw tab or line break inside a string at column 14: "
                              "write it as \\t or \\n) (fix or drop the row; --skip-invalid skips such rows)")


@pytest.mark.parametrize("last", [False, True], ids=["followed", "last-without-break"])
def test_a_line_cut_short_says_so_wherever_it_is(tmp_path, tokenizer, pref_rows, last):
    """A line that stops before its JSON does (cut short, or a record spread over lines) reads
    the same with or without a line break after it: json saw the break as a raw control
    character in a string ("write it as \\n") or named the column after it."""
    good = json.dumps(pref_rows[0]).encode() + b"\n"
    cases = {b'{"prompt": "a", "chosen": " b", "rejected": " c"': "the line ends at column 49",
             b'{"prompt": "sort 3': "the line ends inside a string opened at column 12"}
    for cut, where in cases.items():
        path = tmp_path / "d.jsonl"
        path.write_bytes(good + cut + (b"" if last else b"\n" + good))
        with pytest.raises(DataError) as err:
            _load(path, tokenizer)
        assert str(err.value) == (f"{path}:2: malformed JSON ({where} before its JSON does: cut short, or a record "
                                  "written over several lines; JSON Lines holds one record a line) (fix or drop the "
                                  "row; --skip-invalid skips such rows)")


def test_csv_bad_byte_is_a_row_error_naming_the_column(tmp_path, tokenizer):
    path = tmp_path / "d.csv"
    path.write_bytes(b"prompt,chosen,rejected\nsort 3 1, 1 3, 3 1\nsort 2 1, 1 \xff2, 2 1\nsort 5 4, 4 5, 5 4\n")
    with pytest.raises(DataError, match=rf"{path}:3: field 'chosen': not valid UTF-8 \(byte 0xff\)"):
        _load(path, tokenizer)
    assert len(_load(path, tokenizer, skip_invalid=True)) == 2


def test_json_file_bad_byte_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_bytes(b'[\n{"prompt": "a", "chosen": " b", "rejected": " c"},\n{"prompt": "\xff"}\n]\n')
    with pytest.raises(DataError, match=rf"{path}:3: not valid UTF-8 \(byte 0xff at column 13\)"):
        _load(path, tokenizer)


def test_row_longer_than_the_context_is_named(tmp_path, tokenizer, pref_rows):
    long_row = {"prompt": "sort " * 80, "chosen": " 1", "rejected": " 2"}
    path = write_jsonl([pref_rows[0], long_row, pref_rows[1]], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=rf"{path}:2: \d+ tokens, longer than the model's context \(64"):
        _load(path, tokenizer, context=64)
    with pytest.raises(DataError, match=r"after truncation to max_length=100"):
        _load(path, tokenizer, context=64, max_length=100)
    assert len(_load(path, tokenizer, context=64, max_length=64)) == 3  # truncated to fit: no error
    assert [s.location for s in _load(path, tokenizer, context=64, skip_invalid=True).skipped] == [f"{path}:2"]


def test_a_pair_past_the_context_stops_the_tokenizing_at_its_chunk(tmp_path, tokenizer, pref_rows, monkeypatch):
    """Refused when its chunk is tokenized, not after the whole set (a --max-length past the
    model's context cost minutes of tokenizing at Tulu's size before its one line), in a token
    store's build too; the message is the same, and --skip-invalid still skips the row."""
    from dpocache.data import pairs as pairs_module

    monkeypatch.setattr(pairs_module, "ROWS_PER_CHUNK", 4)
    chunks, real = [], pairs_module._tokenize_chunk

    def counted(chunk, *args):
        chunks.append(len(chunk))
        return real(chunk, *args)

    monkeypatch.setattr(pairs_module, "_tokenize_chunk", counted)
    long_row = {"prompt": "sort " * 80, "chosen": " 1", "rejected": " 2"}
    rows = [*pref_rows[:5], long_row, *pref_rows[5:14]]  # line 6: the second chunk of four
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    for cache in (None, tmp_path / "cache"):
        chunks.clear()
        with pytest.raises(DataError, match=rf"^{path}:6: \d+ tokens, longer than the model's context \(64"):
            load_preference_data(path, tokenizer, context=64, show_progress=False, cache_dir=cache)
        assert chunks == [4, 4]  # of four chunks
    data = load_preference_data(path, tokenizer, context=64, show_progress=False, skip_invalid=True)
    assert [s.location for s in data.skipped] == [f"{path}:6"] and len(data) == len(rows) - 1


def test_counts_of_truncated_and_identical_pairs(tokenizer, pref_rows):
    rows = list(pref_rows[:6]) + [{"prompt": "sort 1 2", "chosen": " 1 2", "rejected": " 1 2"}]
    full = _load(rows, tokenizer)
    assert (full.truncated, full.identical) == (0, 1)
    widths = [len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in full.pairs]
    limit = sorted(widths)[3]
    cut = _load(rows, tokenizer, max_length=limit)
    assert cut.truncated == sum(w > limit for w in widths) > 0
    assert [p.truncated for p in cut.pairs] == [w > limit for w in widths]


def test_csv_row_longer_than_the_csv_field_limit_is_read_and_truncated(tmp_path, tokenizer):
    """The csv module refuses fields over 128 KiB with a traceback; a .jsonl row of that size reads."""
    path = tmp_path / "d.csv"
    path.write_text("prompt,chosen,rejected\n" + "sort " * 40_000 + ", 1 2, 2 1\n")
    data = _load(path, tokenizer, max_length=64)
    assert (len(data), data.truncated) == (1, 1)


def test_null_prompt_is_missing_not_an_implicit_prompt(tmp_path, tokenizer):
    """A parquet column (or a jsonl key) that is there with no value in one row: that row was read
    as implicit-prompt, its prompt taken from the common start of chosen and rejected ("The")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "what is blue?", "chosen": " the sky", "rejected": " the grass"},
            {"prompt": None, "chosen": "The sky is blue.", "rejected": "The grass is green."}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for source, where in ((tmp_path / "d.parquet", "row 1"), (write_jsonl(rows, tmp_path / "d.jsonl"), "2")):
        with pytest.raises(DataError, match=rf"^{source}:{where}: field 'prompt': null"):
            _load(source, tokenizer)
        assert len(_load(source, tokenizer, skip_invalid=True)) == 1
    # Rows with no prompt column at all are still implicit-prompt rows.
    assert len(_load([{k: v for k, v in rows[1].items() if k != "prompt"}], tokenizer)) == 1


def test_dataset_dict_with_several_splits_is_refused(tmp_path, tokenizer, pref_rows):
    """A DatasetDict directory was read as its train split whatever it held, so --eval-data DIR
    evaluated on the training pairs with no word."""
    import datasets

    splits = {"train": datasets.Dataset.from_list(pref_rows[:4]), "test": datasets.Dataset.from_list(pref_rows[4:6])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=rf"^{tmp_path / 'dd'}: a DatasetDict with splits \['train', 'test'\]; "
                       rf"pass one split's directory \({tmp_path / 'dd' / 'train'}\)"):
        _load(tmp_path / "dd", tokenizer)
    assert len(_load(tmp_path / "dd" / "test", tokenizer)) == 2
    datasets.DatasetDict({"test": splits["test"]}).save_to_disk(str(tmp_path / "one"))
    assert _keys(_load(tmp_path / "one", tokenizer)) == _keys(_load(pref_rows[4:6], tokenizer))


def test_messages_written_as_text_are_refused(tmp_path, tokenizer):
    """datasets' to_csv writes a conversational set's messages as their Python repr; read back,
    every field was a plain string and the pair was trained on the literal "[{'role': ...}]"."""
    import datasets

    msgs = {"prompt": [{"role": "user", "content": "sort 3 1 2"}],
            "chosen": [{"role": "assistant", "content": "1 2 3"}],
            "rejected": [{"role": "assistant", "content": "3 2 1"}]}
    datasets.Dataset.from_list([msgs]).to_csv(str(tmp_path / "d.csv"))
    with pytest.raises(DataError, match=rf"^{tmp_path / 'd.csv'}:2: field 'prompt': a list of chat messages written "
                       "as text"):
        _load(tmp_path / "d.csv", tokenizer)
    as_json = {k: json.dumps(v) for k, v in msgs.items()}
    with pytest.raises(DataError, match="field 'prompt': a list of chat messages written as text"):
        _load([as_json], tokenizer)
    # Text that only starts like a list is text.
    assert len(_load([{"prompt": "[{'role': 'user'} is a dict in a list", "chosen": " yes", "rejected": " no"}],
                     tokenizer)) == 1


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.csv"])
def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path, tokenizer, pref_rows, name):
    """Editors and spreadsheets on Windows write UTF-8 with a BOM: the first line was malformed
    JSON, and a CSV's first column was named '\\ufeffprompt' (so 'prompt' was missing)."""
    import csv as csv_module

    rows = pref_rows[:3]
    path = tmp_path / name
    with open(path, "w", encoding="utf-8-sig", newline="") as f:
        if name.endswith(".jsonl"):
            f.writelines(json.dumps(r) + "\n" for r in rows)
        elif name.endswith(".json"):
            json.dump(rows, f)
        else:
            writer = csv_module.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert _keys(_load(path, tokenizer)) == _keys(_load(rows, tokenizer))
