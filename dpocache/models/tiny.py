"""Tiny models and a tokenizer built offline, for the demo, the tests and the benchmarks.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on a small corpus
of generated text, and the models are built from a config with random weights. Both are saved
with ``save_pretrained`` so that every caller goes through the real loading path.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# A chat template in the style of most instruct models: role markers, an end-of-turn token,
# and a generation prompt. The BOS token comes from the template, as in Llama 3's.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no "
    "what up out who them some could into two more other time then its only about these may "
    "sort sorted list numbers answer question please order ascending descending model reward "
    "prompt chosen rejected reference policy cache token train step loss good bad yes"
).split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Generated text covering words, numbers and punctuation, for training the BPE."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(5, 30)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(_WORDS))
            elif r < 0.9:
                parts.append(str(rng.randint(0, 99)))
            else:
                parts.append(rng.choice([",", ".", ":", "?", "!"]))
        lines.append(" ".join(parts))
    return lines


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (any text encodes, no unknown tokens) with a chat template.

    Returns a ``transformers.PreTrainedTokenizerFast``; save it with ``save_pretrained``.
    """
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={},
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Sizes small enough for a CPU test to run a model in milliseconds, large enough to have
# grouped-query attention, several layers and a real output head.
_ARCH_CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512),
    # Gemma 2 soft-caps its final logits (tanh(x / 30) * 30): the fast head must reproduce it.
    "gemma2": dict(
        model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=256,
    ),
    # A mixture of experts: training adds its router load-balancing loss (logged as aux_loss).
    "mixtral": dict(
        model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        num_local_experts=4, num_experts_per_tok=2,
    ),
}

ARCHITECTURES = tuple(_ARCH_CONFIGS)


def build_model(arch: str, tokenizer, seed: int = 0, **overrides):
    """A randomly initialised causal LM of family ``arch`` sized for tests, with the
    tokenizer's vocabulary and special tokens. ``overrides`` change config fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(_ARCH_CONFIGS[arch])
    model_type = fields.pop("model_type")
    fields.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Build the tokenizer and a tiny ``arch`` model and save both to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(arch, tokenizer, seed=seed, **overrides)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
