"""Special tokens of plain-text pairs as users expect them, and as TRL 1.16's DPOTrainer makes
them: one EOS per completion (none added to a completion that already ends with it), and a BOS
only where the tokenizer itself adds one."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing

from dpocache.data.pairs import load_preference_data
from dpocache.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def plain_tok():
    """The tiny byte-level BPE: it adds no special token by itself (as GPT-2's and Qwen's)."""
    return build_tokenizer()


@pytest.fixture(scope="module")
def bos_tok():
    """The same vocabulary with a post-processor that adds BOS in front (as Llama's)."""
    tok = build_tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("a")["input_ids"][0] == tok.bos_token_id
    return tok


@pytest.fixture(scope="module")
def sentencepiece_tok():
    return build_sentencepiece_tokenizer()


def build_sentencepiece_tokenizer():
    """A tokenizer built as Llama 2's and Mistral v0.1's tokenizer.json are: a "▁" put before every
    text and for every space (normalizer), byte fallback, BOS added in front. Tokenized alone, a
    completion " 1 2 3" starts with a lone "▁" that the whole text does not have."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dpocache.models.tiny import CHAT_TEMPLATE, _corpus

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # for training: words start with ▁
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok.train_from_iterator(_corpus(), trainer=trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                   show_progress=False))
    tok.pre_tokenizer = None  # as Llama 2's: the merges never cross a "▁"
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_ids_to_tokens(_enc(fast, " 1")) == ["▁", "▁1"]
    return fast


def _pair(row: dict, tok):
    return load_preference_data([row], tok, show_progress=False).pairs[0]


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_completion_ending_with_eos_gets_no_second_one(plain_tok):
    eos = plain_tok.eos_token_id
    pair = _pair({"prompt": "sort the list", "chosen": " 1 2 3</s>", "rejected": " 3 2 1"}, plain_tok)
    assert list(pair.chosen_ids) == _enc(plain_tok, " 1 2 3") + [eos]
    assert list(pair.rejected_ids) == _enc(plain_tok, " 3 2 1") + [eos]
    assert pair.chosen_ids.count(eos) == 1


def test_bos_only_where_the_tokenizer_adds_one(plain_tok, bos_tok):
    row = {"prompt": "sort the list", "chosen": " 1 2 3", "rejected": " 3 2 1"}
    assert list(_pair(row, plain_tok).prompt_ids) == _enc(plain_tok, "sort the list")
    assert list(_pair(row, bos_tok).prompt_ids) == [bos_tok.bos_token_id] + _enc(bos_tok, "sort the list")
    # A prompt that spells its BOS out keeps exactly one.
    spelled = _pair(dict(row, prompt="<s>sort the list"), bos_tok)
    assert list(spelled.prompt_ids) == [bos_tok.bos_token_id] + _enc(bos_tok, "sort the list")


def _trl_ids(row: dict, tok) -> tuple[list[int], list[int], list[int]]:
    """TRL 1.16's DPOTrainer on a plain-text row, written out independently: EOS text appended
    to a completion that does not end with it, then prompt and prompt + completion tokenized
    with the tokenizer's own special tokens and split where they diverge."""
    eos = tok.eos_token
    chosen = row["chosen"] if row["chosen"].endswith(eos) else row["chosen"] + eos
    rejected = row["rejected"] if row["rejected"].endswith(eos) else row["rejected"] + eos
    prompt_ids = tok(row["prompt"])["input_ids"]
    with_chosen = tok(row["prompt"] + chosen)["input_ids"]
    with_rejected = tok(row["prompt"] + rejected)["input_ids"]

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    n = min(common(prompt_ids, with_chosen), common(prompt_ids, with_rejected))
    return prompt_ids[:n], with_chosen[n:], with_rejected[n:]


@pytest.mark.parametrize("which", ["plain_tok", "bos_tok", "sentencepiece_tok"])
def test_plain_text_ids_are_trls(which, request, make_rows):
    tok = request.getfixturevalue(which)
    rows = make_rows(24, seed=5)
    for i in range(0, len(rows), 3):  # some completions already end with the EOS
        rows[i]["chosen"] += tok.eos_token
    pairs = load_preference_data(rows, tok, show_progress=False).pairs
    for row, pair in zip(rows, pairs):
        assert (list(pair.prompt_ids), list(pair.chosen_ids), list(pair.rejected_ids)) == _trl_ids(row, tok), row


def _score_ids(values: dict, tok):
    from dpocache.cli.score import to_request
    from dpocache.data.pairs import special_prefix
    from dpocache.data.rows import RawRow

    request = to_request(RawRow(0, "rows.jsonl:1", values), tok, special_prefix(tok))
    return request["prompt_ids"], request["completion_ids"]


def test_score_tokenizes_conversations_as_cache_build(plain_tok):
    """`dpocache score` rendered messages with its own copy of the template call: it dropped the
    row's tools and chat_template_kwargs (which cache build passes) and took any content."""
    from test_data import _tools_tokenizer

    tok = _tools_tokenizer(plain_tok)
    prompt = [{"role": "user", "content": "sort 3 1 2"}]
    chosen, rejected = [{"role": "assistant", "content": "1 2 3"}], [{"role": "assistant", "content": "3 2 1"}]
    extra = {"tools": [{"name": "sort_list"}], "chat_template_kwargs": {"enable_thinking": False}}
    pair = _pair({"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}, tok)
    prompt_ids, completion_ids = _score_ids({"prompt": prompt, "completions": [chosen, rejected], **extra}, tok)
    assert (prompt_ids, completion_ids) == (list(pair.prompt_ids), [list(pair.chosen_ids), list(pair.rejected_ids)])
    assert "tools: sort_list" in tok.decode(prompt_ids) and "no thinking" in tok.decode(prompt_ids)


@pytest.mark.parametrize("values, field, reason", [
    ({"prompt": [{"role": "user", "content": "sort"}], "completions": [[{"role": "assistant", "content": None}]]},
     "completions[0][0]", "string 'role' and 'content'"),
    ({"prompt": "sort \ud800", "completions": [" 1"]}, "prompt", "lone surrogate"),
    ({"prompt": "sort", "completions": [" 1", "  "]}, "completions[1]", "only whitespace ('  ')"),
])
def test_score_rows_are_checked_as_cache_builds(plain_tok, values, field, reason):
    """A null content rendered as an empty message and scored (exit 0); a lone surrogate reached
    the tokenizer and stopped the command with a traceback."""
    from dpocache.data.rows import DataError

    with pytest.raises(DataError) as err:
        _score_ids(values, plain_tok)
    assert err.value.field == field and reason in err.value.reason and err.value.location == "rows.jsonl:1"


@pytest.mark.parametrize("which", ["plain_tok", "bos_tok", "sentencepiece_tok"])
def test_conversation_ids_are_trls(which, request):
    """TRL 1.16 on a conversational row: the template tokenized (prompt with the generation
    prompt, prompt + completion) and split where the ids diverge."""
    tok = request.getfixturevalue(which)
    prompt = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "sort 3 1 2"}]
    chosen, rejected = [{"role": "assistant", "content": "1 2 3"}], [{"role": "assistant", "content": " 3 2 1, no"}]

    def ids(messages, **kw):
        return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])

    prompt_ids, with_chosen, with_rejected = ids(prompt, add_generation_prompt=True), ids(prompt + chosen), \
        ids(prompt + rejected)
    n = len(prompt_ids)
    assert with_chosen[:n] == with_rejected[:n] == prompt_ids  # no merge across the boundary here
    pair = _pair({"prompt": prompt, "chosen": chosen, "rejected": rejected}, tok)
    assert (list(pair.prompt_ids), list(pair.chosen_ids), list(pair.rejected_ids)) == \
        (prompt_ids, with_chosen[n:], with_rejected[n:])


def test_a_merge_across_the_boundary_keeps_the_prompts_own_ids(plain_tok):
    """The prompt's trailing space merges into the completion's first word in the whole text:
    the prompt keeps its own ids and the completion is tokenized alone (TRL would cut the
    prompt's last id and score the merged token as completion)."""
    row = {"prompt": "sort the list ", "chosen": "sorted", "rejected": "order"}
    assert _enc(plain_tok, row["prompt"] + "sorted")[:len(_enc(plain_tok, row["prompt"]))] != \
        _enc(plain_tok, row["prompt"])
    pair = _pair(row, plain_tok)
    eos = plain_tok.eos_token_id
    assert (list(pair.prompt_ids), list(pair.chosen_ids), list(pair.rejected_ids)) == \
        (_enc(plain_tok, row["prompt"]), _enc(plain_tok, "sorted") + [eos], _enc(plain_tok, "order") + [eos])


def test_score_tokenizes_plain_text_as_cache_build(sentencepiece_tok, make_rows):
    for row in make_rows(6, seed=2):
        pair = _pair(row, sentencepiece_tok)
        prompt_ids, completion_ids = _score_ids({"prompt": row["prompt"],
                                                 "completions": [row["chosen"], row["rejected"]]}, sentencepiece_tok)
        assert prompt_ids == list(pair.prompt_ids)
        assert completion_ids == [list(pair.chosen_ids), list(pair.rejected_ids)]
