"""Rows to text: each row checked and rendered as its prompt and two completions.

Accepted row formats (those TRL documents):

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``
- conversational: ``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
  messages, rendered with the tokenizer's chat template
- implicit prompt: only ``chosen`` and ``rejected``, as full strings or conversations; their
  longest common prefix is the prompt

A conversational row may also carry, as TRL 1.16 reads them, a ``tools`` column (a list of
JSON-schema function descriptions, or that list as a JSON string) and a ``chat_template_kwargs``
column (an object, e.g. ``{"enable_thinking": false}``); both are passed to the tokenizer's
``apply_chat_template`` for that row only. Plain-text rows have no template to pass them to.

Every bad row, whatever is wrong with it (a missing or empty field, a lone surrogate, messages
written as text, conversations that differ before the answer), is a ``DataError`` naming the
file, the line or row and the field.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Sequence

from dpocache.data.rows import DataError, RawRow, is_messages, parse_json


@dataclass(frozen=True)
class RenderedRow:
    """A valid row as text: the prompt, and each completion as it continues the prompt."""

    prompt: str
    chosen: str
    rejected: str
    templated: bool  # rendered by the chat template (which adds its own special tokens)


def _check_messages(location: str, field_name: str, messages: list) -> None:
    if not messages:
        raise DataError(location, field_name, "empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(location, f"{field_name}[{i}]", "each message needs string 'role' and 'content'")
        _check_encodable(location, f"{field_name}[{i}]", m["role"] + m["content"])


def _check_encodable(location: str, field_name: str, value: str) -> None:
    """A lone surrogate (a JSON ``\\ud800`` escape without its pair) is a valid Python string
    but no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(location, field_name, f"a lone surrogate U+{ord(value[e.start]):04X} at character "
                        f"{e.start + 1} (an unpaired \\u escape) is not text") from None


def check_text(location: str, field_name: str, value: Any) -> str:
    """A plain-text field as a string, or a ``DataError`` saying why it is not one."""
    if value is None:
        raise DataError(location, field_name, "missing")
    if not isinstance(value, str):
        raise DataError(location, field_name, f"expected a string or a list of messages, got {type(value).__name__}")
    if not value.strip():
        raise DataError(location, field_name, "empty string" if not value else f"only whitespace ({value!r})")
    _check_encodable(location, field_name, value)
    if _written_messages(value):
        raise DataError(location, field_name, "a list of chat messages written as text (as datasets' to_csv writes "
                        "them); give the rows as .jsonl, .parquet or a datasets directory, which keep them as lists")
    return value


def _written_messages(text: str) -> bool:
    """Whether the whole text is a list of {"role", "content"} messages as JSON or a Python repr
    (what a CSV cell holds when a conversational set is written to CSV): as plain text the pair
    would be trained on the brackets and quotes."""
    text = text.strip()
    if not (text.startswith("[{") and text.endswith("}]")):
        return False
    try:
        value = ast.literal_eval(text)  # a Python literal; JSON's null/true/false aside, JSON is one too
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return False
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _common_prefix_len(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_divergence(location: str, chosen: list, rejected: list, n: int) -> None:
    """Conversations that first differ at message ``n`` in a user's or the system's turn: the
    prompt would end on an answer and the completions start with the user's words, which the
    chat template then refused as "not a prefix", naming neither. Said as it is."""
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        role = messages[n].get("role") if n < len(messages) else None
        if role in ("user", "system"):
            raise DataError(location, name, f"chosen and rejected differ first at message {n}, a {role} turn: a "
                            "pair's conversations may differ in the assistant's answer only (the turns before it "
                            "are the prompt)")


def _split_implicit(location: str, chosen: Any, rejected: Any, text_prompt: bool = False) -> tuple[Any, Any, Any]:
    """Implicit prompt: the longest common prefix of chosen and rejected is the prompt.
    ``text_prompt``: the row's prompt is text beside these conversations, and not used."""
    if is_messages(chosen) and is_messages(rejected):
        for name, messages in (("chosen", chosen), ("rejected", rejected)):
            _check_messages(location, name, messages)  # indices as in the row, before the split
        n = _common_prefix_len(chosen, rejected)
        if n and n == min(len(chosen), len(rejected)):
            # One is the start of the other, or both the same (an answer given twice): as TRL's
            # extract_prompt, the last message they share is an answer in each.
            n -= 1
            if n == 0:
                shorter = "chosen" if len(chosen) <= len(rejected) else "rejected"
                raise DataError(location, shorter, "one message, which the other completion starts with: no prompt "
                                "before the answers")
        if n == 0 and text_prompt:
            raise DataError(location, "prompt", "text, where chosen and rejected are conversations; such rows are "
                            "read as their messages both start with, but these share no first message: give the "
                            "prompt as messages too")
        if n == 0:
            raise DataError(location, "chosen", "implicit prompt: chosen and rejected share no first message")
        _check_divergence(location, chosen, rejected, n)
        return chosen[:n], chosen[n:], rejected[n:]
    chosen = check_text(location, "chosen", chosen)
    rejected = check_text(location, "rejected", rejected)
    n = _common_prefix_len(chosen, rejected)
    # Cut at a word boundary, so that the completion starts with its own word rather than the
    # tail of a shared one (TRL 1.16's extract_prompt cuts where the texts differ: "The answer
    # is 4" + "2"; see docs/data.md).
    while n > 0 and not chosen[n - 1].isspace() and n < len(chosen) and not chosen[n].isspace():
        n -= 1
    # Leave the space to the completion (" blue", not "blue"): BPE vocabularies hold words
    # with their leading space.
    if n > 0 and chosen[n - 1] == " ":
        n -= 1
    if n == 0:
        raise DataError(location, "chosen", "implicit prompt: chosen and rejected share no prefix")
    return chosen[:n], chosen[n:], rejected[n:]


# Arguments dpocache itself gives apply_chat_template: a row cannot override them.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                             "return_dict", "return_tensors")


def _parse_json_field(loc: str, field_name: str, text: str) -> Any:
    try:
        return parse_json(loc, text)
    except DataError as e:
        raise DataError(loc, field_name, e.reason) from None


def template_inputs(loc: str, values: dict) -> dict:
    """The row's extra ``apply_chat_template`` arguments: its ``tools`` and ``chat_template_kwargs``."""
    kwargs = values.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif isinstance(kwargs, str):  # a CSV cell, or a column stored as text
        kwargs = _parse_json_field(loc, "chat_template_kwargs", kwargs)
    if not isinstance(kwargs, dict):
        raise DataError(loc, "chat_template_kwargs", f"expected an object, got {type(kwargs).__name__}")
    reserved = [k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise DataError(loc, "chat_template_kwargs", f"'{reserved[0]}' is set by dpocache, not per row")
    kwargs = dict(kwargs)
    tools = values.get("tools")
    if isinstance(tools, str):
        tools = _parse_json_field(loc, "tools", tools) if tools.strip() else None
    if tools is not None:
        if not isinstance(tools, list):
            raise DataError(loc, "tools", f"expected a list of tool descriptions, got {type(tools).__name__}")
        kwargs["tools"] = tools
    return kwargs


def render_row(row: RawRow, tokenizer) -> RenderedRow:
    if row.error is not None:
        raise row.error
    values = row.values
    loc = row.location
    if not isinstance(values, dict):
        raise DataError(loc, None, f"expected an object with prompt/chosen/rejected, got {type(values).__name__}")
    for name in ("chosen", "rejected"):
        if values.get(name) is None:
            raise DataError(loc, name, "missing")
    prompt, chosen, rejected = values.get("prompt"), values["chosen"], values["rejected"]
    if prompt is None:
        prompt, chosen, rejected = _split_implicit(loc, chosen, rejected)
    elif isinstance(prompt, str) and is_messages(chosen) and is_messages(rejected):
        # A text prompt beside conversations that hold it (Tulu 3's preference mixtures: the user's
        # turn in chosen and rejected, and again as text): the prompt is the messages both start
        # with, as TRL 1.16's maybe_extract_prompt reads such rows and open-instruct trains them.
        prompt, chosen, rejected = _split_implicit(loc, chosen, rejected, text_prompt=True)
    kinds = {name: is_messages(v) for name, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
    if all(kinds.values()):
        prompt_text, (chosen_text, rejected_text) = render_conversation(
            loc, prompt, [("chosen", chosen), ("rejected", rejected)], tokenizer, template_inputs(loc, values))
        return RenderedRow(prompt_text, chosen_text, rejected_text, templated=True)
    if any(kinds.values()):
        odd = [n for n, is_msgs in kinds.items() if not is_msgs]
        raise DataError(loc, odd[0], "mixes messages and plain text: give all fields as messages or all as strings")
    return RenderedRow(
        check_text(loc, "prompt", prompt), check_text(loc, "chosen", chosen),
        check_text(loc, "rejected", rejected), templated=False,
    )


def render_conversation(loc: str, prompt: list, completions: Sequence[tuple[str, list]], tokenizer,
                        template_kwargs: dict | None = None) -> tuple[str, list[str]]:
    """The prompt's text (with the generation prompt) and each completion's text as it continues
    it, after checking every message. ``completions``: (field name, messages) for each;
    ``template_kwargs``: the row's ``tools`` and ``chat_template_kwargs`` (see ``template_inputs``).
    The one renderer of messages, for pairs and for ``dpocache score``'s rows alike."""
    template_kwargs = template_kwargs or {}
    for name, msgs in (("prompt", prompt), *completions):
        _check_messages(loc, name, msgs)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(loc, "prompt", "conversational row but the tokenizer has no chat template")
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
    texts = []
    for name, msgs in completions:
        full = tokenizer.apply_chat_template(prompt + msgs, tokenize=False, **template_kwargs)
        if not full.startswith(prompt_text):
            raise DataError(loc, name, "the chat template does not render the prompt as a prefix of the conversation")
        texts.append(full[len(prompt_text):])
    return prompt_text, texts
