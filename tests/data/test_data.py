"""Tests for dpocache.data (rows, render, pairs): sources, row formats, validation errors, truncation and keys."""

from __future__ import annotations

import csv
import json
import re

import pytest

from dpocache.data.pairs import example_key, load_preference_data, tokenize_rows, truncate_pair
from dpocache.data.rows import DataError, read_rows, write_jsonl


def _load(source, tokenizer, **kwargs):
    return load_preference_data(source, tokenizer, show_progress=False, **kwargs)


def _keys(data):
    return [p.key for p in data.pairs]


# ------------------------------------------------------------------------------------ sources


def _write_csv(rows, path):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_every_source_gives_the_same_keys(tmp_path, tokenizer, make_rows):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_rows(12, seed=3)
    # A comma and a quote exercise CSV quoting; leading spaces must survive every format.
    rows[0]["chosen"] = ' yes, "sorted" list'
    jsonl = write_jsonl(rows, tmp_path / "d.jsonl")
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    _write_csv(rows, tmp_path / "d.csv")
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "hf_dir"))

    expected = _keys(_load(jsonl, tokenizer))
    assert len(expected) == len(rows) == len(set(expected))
    sources = {
        "json list": tmp_path / "list.json",
        "json {data}": tmp_path / "wrapped.json",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "save_to_disk dir": tmp_path / "hf_dir",
        "datasets.Dataset": ds,
        "list of dicts": rows,
    }
    for name, source in sources.items():
        assert _keys(_load(source, tokenizer)) == expected, name


def test_standard_rows_get_eos_and_the_tokenizers_own_bos(tokenizer):
    row = {"prompt": "sort the list", "chosen": " 1 2 3", "rejected": " 3 2 1"}
    pair = _load([row], tokenizer).pairs[0]

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # The tiny tokenizer adds no BOS by itself (as GPT-2's), so the prompt gets none (TRL's rule;
    # test_tokenization.py covers a tokenizer that adds one).
    assert list(pair.prompt_ids) == tokenizer("sort the list")["input_ids"] == enc("sort the list")
    assert list(pair.chosen_ids) == enc(" 1 2 3") + [tokenizer.eos_token_id]
    assert list(pair.rejected_ids) == enc(" 3 2 1") + [tokenizer.eos_token_id]
    assert pair.key == example_key(pair.prompt_ids, pair.chosen_ids, pair.rejected_ids)


def _conversation_row():
    prompt = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "sort 3 1 2"}]
    chosen = [{"role": "assistant", "content": "1 2 3"}]
    rejected = [{"role": "assistant", "content": "3 2 1, sorted"}]
    return prompt, chosen, rejected


def test_conversational_rows_use_the_chat_template(tokenizer):
    prompt, chosen, rejected = _conversation_row()
    pair = _load([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], tokenizer).pairs[0]

    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert prompt_text.startswith("<s><|system|>answer briefly<|end|>") and prompt_text.endswith("<|assistant|>")
    assert tokenizer.decode(pair.prompt_ids) == prompt_text
    for completion, ids in ((chosen, pair.chosen_ids), (rejected, pair.rejected_ids)):
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        assert tokenizer.decode(pair.prompt_ids + ids) == full
    # The template brings its own BOS and end-of-turn: nothing is added on top.
    assert pair.prompt_ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.eos_token_id not in pair.chosen_ids + pair.rejected_ids


def test_implicit_prompt_strings_equal_the_explicit_row(tokenizer):
    explicit = {"prompt": "row 7: sort the list", "chosen": " 1 2 3", "rejected": " 3 2 1"}
    implicit = {"chosen": "row 7: sort the list 1 2 3", "rejected": "row 7: sort the list 3 2 1"}
    # "the list 1" and "the list 3" share no more than the words: the prompt ends at a word
    # boundary and each completion keeps its leading space.
    a, b = _load([explicit, implicit], tokenizer).pairs
    assert (a.prompt_ids, a.chosen_ids, a.rejected_ids) == (b.prompt_ids, b.chosen_ids, b.rejected_ids)
    assert a.key == b.key


def test_implicit_prompt_shared_word_prefix_cut_at_boundary(tokenizer):
    # Common character prefix "row 8: the sor" ends inside a word: the prompt is "row 8: the".
    implicit = {"chosen": "row 8: the sorted list", "rejected": "row 8: the sort order"}
    explicit = {"prompt": "row 8: the", "chosen": " sorted list", "rejected": " sort order"}
    a, b = _load([implicit, explicit], tokenizer).pairs
    assert a.key == b.key


def test_implicit_prompt_conversations_equal_the_explicit_row(tokenizer):
    prompt, chosen, rejected = _conversation_row()
    explicit = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    implicit = {"chosen": prompt + chosen, "rejected": prompt + rejected}
    a, b = _load([explicit, implicit], tokenizer).pairs
    assert a.key == b.key


def test_a_text_prompt_beside_conversations_that_hold_it_is_their_shared_messages(tokenizer):
    """Tulu 3's preference mixtures (the seeds' data): ``prompt`` the user's turn as text,
    ``chosen`` and ``rejected`` whole conversations starting with it. As TRL 1.16 reads them
    (``maybe_extract_prompt``) and open-instruct trains them, the prompt is the messages both
    start with; the text is not used. Each row equals its explicit conversational row."""
    prompt, chosen, rejected = _conversation_row()
    turns = prompt + [{"role": "assistant", "content": "3 2 1"}, {"role": "user", "content": "again, sorted"}]
    rows, explicit = [], []
    for shared in (prompt, turns):  # one turn, and several (the text prompt is then the last)
        rows.append({"id": "x", "source": "s", "prompt": shared[-1]["content"], "chosen": shared + chosen,
                     "rejected": shared + rejected})
        explicit.append({"prompt": shared, "chosen": chosen, "rejected": rejected})
    got, want = _load(rows, tokenizer).pairs, _load(explicit, tokenizer).pairs
    for a, b in zip(got, want):
        assert (a.prompt_ids, a.chosen_ids, a.rejected_ids, a.key) == (b.prompt_ids, b.chosen_ids, b.rejected_ids,
                                                                        b.key)
    assert got[0].key != got[1].key


def test_conversations_one_the_start_of_the_other_end_the_prompt_a_message_early_as_trl(tokenizer):
    """chosen and rejected the same conversation (an answer given twice: Tulu's mixtures have
    such rows) or one the start of the other: as TRL's extract_prompt, the last message they
    share is an answer in each, so the row is kept (counted with chosen == rejected), where it
    stopped the build with "empty list of messages"."""
    prompt, chosen, _ = _conversation_row()
    longer = chosen + [{"role": "user", "content": "and again"}, {"role": "assistant", "content": "1 2 3"}]
    for implicit in ({"chosen": prompt + chosen, "rejected": prompt + chosen},
                     {"prompt": "the user's text", "chosen": prompt + chosen, "rejected": prompt + chosen}):
        data = _load([implicit, {"prompt": prompt, "chosen": chosen, "rejected": chosen}], tokenizer)
        assert data.pairs[0].key == data.pairs[1].key and data.identical == 2
    data = _load([{"chosen": prompt + chosen, "rejected": prompt + longer},
                  {"prompt": prompt, "chosen": chosen, "rejected": longer}], tokenizer)
    assert data.pairs[0].key == data.pairs[1].key


# ------------------------------------------------------------------------------------ errors


GOOD = {"prompt": "sort the list", "chosen": " 1 2 3", "rejected": " 3 2 1"}
MSGS = [{"role": "user", "content": "sort"}]
BAD_ROWS = {
    "missing field": ({"prompt": "sort", "chosen": " 1 2"}, "rejected", "missing"),
    "empty string": ({"prompt": "", "chosen": " 1", "rejected": " 2"}, "prompt", "empty string"),
    "only whitespace": ({"prompt": "   ", "chosen": " 1", "rejected": " 2"}, "prompt", "only whitespace ('   ')"),
    "wrong type": ({"prompt": "sort", "chosen": 5, "rejected": " 2"}, "chosen", "expected a string"),
    "messages mixed with strings": ({"prompt": MSGS, "chosen": " 1", "rejected": " 2"}, "chosen", "mixes messages"),
    # messages named as in the row (the implicit prompt's split came first: rejected[1] was 'rejected[0]')
    "a message without content in an implicit row": (
        {"chosen": MSGS + [{"role": "assistant", "content": "1"}], "rejected": MSGS + [{"role": "assistant"}]},
        "rejected[1]", "content"),
    "an empty conversation beside a text prompt": (
        {"prompt": "sort", "chosen": [], "rejected": MSGS + [{"role": "assistant", "content": "2"}]}, "chosen",
        "empty list of messages"),
    "a conversation that is the other's prompt": (
        {"chosen": MSGS, "rejected": MSGS + [{"role": "assistant", "content": "2"}]}, "chosen",
        "one message, which the other completion starts with: no prompt before the answers"),
    "a text prompt beside one conversation": ({"prompt": "sort", "chosen": MSGS, "rejected": " 2"}, "prompt",
                                              "mixes messages"),
    "a text prompt beside conversations without it": (
        {"prompt": "sort", "chosen": [{"role": "assistant", "content": "1"}],
         "rejected": [{"role": "assistant", "content": "2"}]}, "prompt", "share no first message: give the prompt as "
                                                                         "messages too"),
    "message without content": (
        {"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "1"}],
         "rejected": [{"role": "assistant", "content": "2"}]}, "prompt[0]", "content"),
    # the second user turn differs (the chat template's "not a prefix" named neither)
    "conversations that differ first in a user's turn": (
        {"chosen": MSGS + [{"role": "assistant", "content": "1"}, {"role": "user", "content": "again"},
                           {"role": "assistant", "content": "1"}],
         "rejected": MSGS + [{"role": "assistant", "content": "1"}, {"role": "user", "content": "once more"},
                             {"role": "assistant", "content": "2"}]}, "chosen",
        "chosen and rejected differ first at message 2, a user turn: a pair's conversations may differ in the "
        "assistant's answer only"),
}


def test_malformed_json_line_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    # A blank line still counts as a line: the error must name the file's own line number.
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n" + '{"prompt": "x", "chosen": \n')
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    assert f"{path}:4" in str(err.value)
    assert "malformed JSON" in str(err.value)


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_error_names_file_line_and_field(tmp_path, tokenizer, case):
    row, field, reason = BAD_ROWS[case]
    path = write_jsonl([GOOD, row, GOOD], tmp_path / "d.jsonl")
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    msg = str(err.value)
    assert f"{path}:2" in msg, msg
    assert f"'{field}'" in msg, msg
    assert reason in msg, msg


def test_the_bad_row_that_stops_a_run_names_the_unreadable_rows_after_it(tmp_path, tokenizer):
    """One run names every row a glance finds bad (a line cut short, a row without rejected):
    the first stopped the run alone, three bad rows cost three runs to find."""
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(GOOD), '{"prompt": "x", "chosen": "y"', json.dumps(GOOD),
             json.dumps({"prompt": "sort", "chosen": " 1"}), json.dumps({**GOOD, "chosen": ""}), '{"prompt": ']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    message = str(err.value)
    assert message.startswith(f"{path}:2: malformed JSON") and "--skip-invalid skips such rows" in message
    # the empty completion (line 5) is found as the rows are rendered, not at a glance
    assert message.endswith(f"; 2 more rows after it cannot be read or lack chosen or rejected ({path}:4, {path}:6)")
    assert [s.location for s in _load(path, tokenizer, skip_invalid=True).skipped] == [
        f"{path}:{n}" for n in (2, 4, 5, 6)]


@pytest.mark.parametrize("first", [False, True], ids=["after-good-rows", "first-row"])
def test_a_row_without_values_other_rows_have_is_the_rows_problem_not_the_mapping(tmp_path, tokenizer, first):
    """Row 2 of 3 (or row 1) lacks 'rejected' or both completions while the others have them: the
    message said to map a column ("pass --data.rejected_field COLUMN"), which every other row
    has; it says to fix or drop the row, as a skipped row's reason says what it lacks."""
    hint = "(fix or drop the row; --skip-invalid skips such rows)"
    cases = {"rejected": ({"prompt": "sort", "chosen": " 1 2"}, "field 'rejected': missing, where other rows have it"),
             "both": ({"prompt": "sort"}, "fields 'chosen', 'rejected' missing, where other rows have them")}
    for row, said in cases.values():
        path = write_jsonl([row, GOOD, GOOD] if first else [GOOD, row, GOOD], tmp_path / "d.jsonl")
        line = 1 if first else 2
        with pytest.raises(DataError) as err:
            _load(path, tokenizer)
        assert str(err.value) == f"{path}:{line}: {said} {hint}"
        assert [str(s) for s in _load(path, tokenizer, skip_invalid=True).skipped] == [f"{path}:{line}: {said}"]
    # a row's own empty completion after good rows says the same; in a file's first row it is said as before
    path = write_jsonl([GOOD, {**GOOD, "chosen": ""}], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: field 'chosen': empty string {hint}")):
        _load(path, tokenizer)
    path = write_jsonl([{**GOOD, "chosen": ""}, GOOD], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=re.escape(f"{path}:1: field 'chosen': empty string") + "$"):
        _load(path, tokenizer)
    # no row has the column: the mapping is the question, as before
    path = write_jsonl([{"prompt": "sort", "chosen": " 1 2", "bad": " 2 1"}] * 2, tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="field 'rejected': missing; the row has columns .*--data.rejected_field bad"):
        _load(path, tokenizer)


def test_csv_error_names_the_line(tmp_path, tokenizer):
    path = _write_csv([GOOD, {"prompt": "sort", "chosen": "", "rejected": " 2"}], tmp_path / "d.csv")
    with pytest.raises(DataError) as err:
        _load(path, tokenizer)
    assert f"{path}:3" in str(err.value)  # line 1 is the header
    assert "'chosen'" in str(err.value)


def test_prompt_that_leaves_no_room_is_a_bad_row(tmp_path, tokenizer):
    path = write_jsonl([GOOD, GOOD], tmp_path / "d.jsonl")
    # One token of room: the prompt keeps (at least) one token, so no completion fits.
    with pytest.raises(DataError) as err:
        _load(path, tokenizer, max_length=1)
    msg = str(err.value)
    assert f"{path}:1" in msg and "'prompt'" in msg and "no room" in msg, msg


def test_truncation_never_leaves_an_empty_prompt(tokenizer):
    """A completion token at position 0 has nothing to condition on and is never scored (see
    ``CompletionLogProbs.forward``): truncation must keep a prompt token, whatever P says."""
    row = {"prompt": "sort the list please", "chosen": " " + "1 2 " * 10, "rejected": " 3 2 1"}
    for max_length in (2, 4, 8):
        pair = _load([row], tokenizer, max_length=max_length, max_prompt_length=0).pairs[0]
        assert len(pair.prompt_ids) >= 1
        assert len(pair.prompt_ids) + len(pair.chosen_ids) <= max_length
        assert len(pair.chosen_ids) >= 1 and len(pair.rejected_ids) >= 1


def test_skip_invalid_skips_and_reports(tmp_path, tokenizer, make_rows):
    long_prompt = {"prompt": " ".join(["sort"] * 40), "chosen": " 1", "rejected": " 2"}
    rows = [GOOD, BAD_ROWS["missing field"][0], make_rows(1)[0], BAD_ROWS["wrong type"][0], long_prompt]
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    data = _load(path, tokenizer, skip_invalid=True)
    assert [p.index for p in data.pairs] == [0, 2, 4]
    assert [(s.location, s.field) for s in data.skipped] == [(f"{path}:2", "rejected"), (f"{path}:4", "chosen")]
    assert "missing" in str(data.skipped[0]) and f"{path}:2" in str(data.skipped[0])

    # Rows invalid only after tokenization (no room within max_length) are skipped too.
    _, raw = read_rows(path)
    pairs, skipped = tokenize_rows(raw, tokenizer, max_length=1, skip_invalid=True, show_progress=False)
    assert pairs == []
    assert sorted(s.location for s in skipped) == [f"{path}:{i}" for i in range(1, 6)]
    assert all("no room" in s.reason for s in skipped if s.location.endswith((":1", ":3", ":5")))


def test_skip_invalid_with_nothing_valid_is_an_error(tmp_path, tokenizer):
    path = write_jsonl([BAD_ROWS["missing field"][0]], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="no valid rows"):
        _load(path, tokenizer, skip_invalid=True)


def test_unknown_file_type(tmp_path, tokenizer):
    path = tmp_path / "d.txt"
    path.write_text("x")
    with pytest.raises(DataError, match="unknown file type"):
        _load(path, tokenizer)


# ------------------------------------------------------------------------------------ truncation


P10 = list(range(100, 110))  # prompt of 10 tokens
C6 = list(range(200, 206))  # completion of 6
R4 = list(range(300, 304))  # completion of 4


def test_truncate_nothing_when_it_fits():
    assert truncate_pair(P10, C6, R4, 16, 4) == (P10, C6, R4)
    assert truncate_pair(P10, C6, R4, None, None) == (P10, C6, R4)


def test_truncate_prompt_keeps_its_end_only_as_much_as_needed():
    # L=12: 10 + 6 > 12; the prompt keeps max(P=4, 12-6=6) = 6 tokens, its last six;
    # the completions then have 12 - 6 = 6 tokens of room and lose nothing.
    p, c, r = truncate_pair(P10, C6, R4, 12, 4)
    assert p == P10[-6:] == list(range(104, 110))
    assert (c, r) == (C6, R4)


def test_truncate_prompt_floor_then_completions_keep_their_start():
    # L=8, P=5: the prompt keeps max(5, 8-6=2) = 5 (its last five); completions keep their
    # first 8 - 5 = 3 tokens.
    p, c, r = truncate_pair(P10, C6, R4, 8, 5)
    assert p == [105, 106, 107, 108, 109]
    assert c == [200, 201, 202]
    assert r == [300, 301, 302]


def test_truncate_default_prompt_floor_is_half():
    # P unset: floor L//2 = 4 → the prompt keeps its last 4, completions their first 4.
    p, c, r = truncate_pair(P10, C6, R4, 8, None)
    assert p == P10[-4:]
    assert c == C6[:4] and r == R4


def test_truncate_prompt_keeps_at_least_one_token():
    # L=4, P=0, longest 6: max(0, 4-6, 1) = 1 prompt token (its last); completions get 3.
    p, c, r = truncate_pair(P10, C6, R4, 4, 0)
    assert p == [109] and c == C6[:3] and r == R4[:3]
    # L=1: the one kept prompt token leaves no room (the loader rejects the row).
    p, c, r = truncate_pair(P10, C6, R4, 1, 0)
    assert p == [109] and c == [] and r == []


def test_truncate_short_prompt_is_kept_whole():
    # The prompt (3) is shorter than the floor: kept whole; completions get 8 - 3 = 5.
    p, c, r = truncate_pair([1, 2, 3], C6, R4, 8, 5)
    assert p == [1, 2, 3] and c == C6[:5] and r == R4


def test_truncation_through_the_loader(tokenizer):
    row = {"prompt": "row 1: " + " ".join(["sort the list"] * 6), "chosen": " " + " ".join(["yes"] * 12),
           "rejected": " no"}
    full = _load([row], tokenizer).pairs[0]
    n_prompt, n_chosen, n_rejected = len(full.prompt_ids), len(full.chosen_ids), len(full.rejected_ids)
    assert n_prompt > 12 and n_chosen == 13 and n_rejected == 2  # 12 "yes" + EOS; " no" + EOS

    cut = _load([row], tokenizer, max_length=20, max_prompt_length=10).pairs[0]
    # Prompt keeps max(10, 20 - 13 = 7) = 10: its end; completions keep their first 10.
    assert cut.prompt_ids == full.prompt_ids[-10:]
    assert cut.chosen_ids == full.chosen_ids[:10]
    assert cut.rejected_ids == full.rejected_ids
    assert cut.key != full.key


# ------------------------------------------------------------------------------------ keys


def test_key_changes_iff_ids_change(tokenizer):
    row = {"prompt": "sort the list", "chosen": " 1 2 3", "rejected": " 3 2 1"}
    base = _load([row], tokenizer).pairs[0]
    n = len(base.prompt_ids) + max(len(base.chosen_ids), len(base.rejected_ids))
    # A limit that cuts nothing leaves the ids, so the key, unchanged.
    same = _load([dict(row)], tokenizer, max_length=n, max_prompt_length=1).pairs[0]
    assert same.prompt_ids == base.prompt_ids and same.key == base.key
    # One token less changes the ids, so the key.
    cut = _load([row], tokenizer, max_length=n - 1, max_prompt_length=1).pairs[0]
    assert cut.prompt_ids + cut.chosen_ids != base.prompt_ids + base.chosen_ids and cut.key != base.key
    # The row's position does not enter the key; its text does.
    moved = _load([GOOD | {"prompt": "other"}, row], tokenizer).pairs[1]
    assert moved.index == 1 and moved.key == base.key
    edited = _load([row | {"rejected": " 3 2 1 ."}], tokenizer).pairs[0]
    assert edited.key != base.key


def test_example_key_hashes_the_boundaries():
    assert example_key([1, 2], [3], [4]) != example_key([1], [2, 3], [4])
    assert example_key([1], [2], [3]) != example_key([1], [3], [2])
    assert example_key([1], [2, 3], [4]) != example_key([1], [3, 2], [4])  # order within a sequence
    assert example_key([1], [2], [3]) == example_key((1,), (2,), (3,))
    assert len(example_key([1], [2], [3])) == 16


# ------------------------------------------------------------------ per-row chat-template inputs

# The tiny template, plus what a tool-calling template does with its inputs: it writes them out.
_TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['name'] }}{% endfor %}<|end|>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<|system|>no thinking<|end|>{% endif %}"
)


def _tools_tokenizer(tokenizer):
    import copy

    from dpocache.models.tiny import CHAT_TEMPLATE

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}" + _TOOLS_TEMPLATE)
    return tok


def test_tools_and_chat_template_kwargs_reach_the_template(tokenizer):
    tok = _tools_tokenizer(tokenizer)
    prompt, chosen, rejected = _conversation_row()
    tools = [{"name": "sort_list", "description": "sort numbers", "parameters": {"type": "object"}}]
    plain = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    with_tools = dict(plain, tools=tools)
    with_kwargs = dict(plain, chat_template_kwargs={"enable_thinking": False})
    both = dict(plain, tools=json.dumps(tools), chat_template_kwargs=json.dumps({"enable_thinking": False}))
    a, b, c, d = _load([plain, with_tools, with_kwargs, both], tok).pairs

    # Each row's ids are the template rendered with that row's inputs (an independent call).
    for pair, extra in ((a, {}), (b, {"tools": tools}), (c, {"enable_thinking": False}),
                        (d, {"tools": tools, "enable_thinking": False})):
        prompt_text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **extra)
        assert tok.decode(pair.prompt_ids) == prompt_text
        full = tok.apply_chat_template(prompt + chosen, tokenize=False, **extra)
        assert tok.decode(pair.prompt_ids + pair.chosen_ids) == full
    assert "tools: sort_list" in tok.decode(b.prompt_ids) and "no thinking" not in tok.decode(b.prompt_ids)
    assert "no thinking" in tok.decode(c.prompt_ids) and "tools:" not in tok.decode(c.prompt_ids)
    assert "tools: sort_list" in tok.decode(d.prompt_ids) and "no thinking" in tok.decode(d.prompt_ids)
    # The inputs change the ids, so they change the key; the completions are untouched.
    assert len({a.key, b.key, c.key, d.key}) == 4
    assert a.chosen_ids == b.chosen_ids == c.chosen_ids == d.chosen_ids


def test_template_inputs_survive_column_mapping(tokenizer, tmp_path):
    tok = _tools_tokenizer(tokenizer)
    prompt, chosen, rejected = _conversation_row()
    tools = [{"name": "sort_list"}]
    path = write_jsonl([{"question": prompt, "good": chosen, "bad": rejected, "tools": tools}], tmp_path / "d.jsonl")
    pair = _load(path, tok, columns=("question", "good", "bad")).pairs[0]
    assert "tools: sort_list" in tok.decode(pair.prompt_ids)


@pytest.mark.parametrize("extra, field, reason", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "expected an object"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "set by dpocache"),
    ({"chat_template_kwargs": "{not json"}, "chat_template_kwargs", "malformed JSON"),
    ({"tools": {"name": "x"}}, "tools", "expected a list"),
])
def test_bad_template_inputs_name_the_field(tokenizer, extra, field, reason):
    prompt, chosen, rejected = _conversation_row()
    with pytest.raises(DataError) as e:
        _load([dict(prompt=prompt, chosen=chosen, rejected=rejected, **extra)], tokenizer)
    assert e.value.field == field and reason in e.value.reason and "row 0" in e.value.location


def test_conversation_rows_without_their_text_prompt_read_as_those_with_it(tmp_path, tokenizer):
    """A Tulu-style mixture whose shards differ: one with a text prompt beside the conversations,
    one without the column (but with others: id, source), one with it null. The text is never
    used for conversations, so all read alike; they were refused as "missing, where other rows
    have it", with advice (--skip-invalid) that dropped the shard."""
    user = {"role": "user", "content": "sort 3 1"}
    conversation = {"chosen": [user, {"role": "assistant", "content": "1 3"}],
                    "rejected": [user, {"role": "assistant", "content": "3 1"}]}
    rows = [{"prompt": "sort 3 1", "id": "a", **conversation}, {"id": "b", "source": "wildchat", **conversation},
            {"prompt": None, "id": "c", **conversation}]
    path = write_jsonl(rows, tmp_path / "mixed.jsonl")
    data = _load(path, tokenizer)
    keys = [p.key for p in data.pairs]
    assert len(keys) == 3 and len(set(keys)) == 1 and not data.skipped
    # text rows keep their checks: a null prompt beside text completions lost its prompt
    with pytest.raises(DataError, match="field 'prompt': null"):
        _load(write_jsonl([GOOD, {**GOOD, "prompt": None}], tmp_path / "text.jsonl"), tokenizer)


def test_a_tokenizer_not_loaded_is_named(tmp_path, model_dir):
    path = write_jsonl([{"prompt": "a", "chosen": " b", "rejected": " c"}], tmp_path / "d.jsonl")
    with pytest.raises(TypeError, match=r"^tokenizer: expected a tokenizer, got str; load it first: "
                       r"transformers.AutoTokenizer.from_pretrained\(model_dir\)"):
        load_preference_data(path, str(model_dir))


def test_max_prompt_length_one_below_max_length_truncates_as_trl_and_open_instruct():
    """docs/data.md: ``--max-prompt-length L-1`` keeps the prompt whole and cuts each completion,
    as TRL 1.16's collator and open-instruct cut prompt + completion (its start, L tokens), for
    every prompt shorter than L; checked against that cut, written out, over many lengths."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        max_length = rng.randint(2, 64)
        prompt = list(range(rng.randint(1, max_length - 1)))
        chosen = list(range(100, 100 + rng.randint(1, 80)))
        rejected = list(range(200, 200 + rng.randint(1, 80)))
        kept = truncate_pair(prompt, chosen, rejected, max_length, max_length - 1)
        start_of = [(prompt + c)[:max_length] for c in (chosen, rejected)]  # the start of each sequence
        assert [kept[0] + kept[1], kept[0] + kept[2]] == start_of
