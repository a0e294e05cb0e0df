"""Shared pieces of the benchmarks: model configurations, the generated preference set, and
the inputs directory both sides read (a ``save_pretrained`` model with its tokenizer, and a
JSONL file of standard-format rows).

Nothing is downloaded: the model is built from a config with random weights, the tokenizer is
``dpocache.tiny.build_tokenizer`` (a byte-level BPE trained offline), the text is random words.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BenchConfig:
    name: str
    # Llama body
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    # data: words per prompt and per completion (uniform in the range)
    prompt_words: tuple[int, int] = (20, 120)
    completion_words: tuple[int, int] = (10, 150)
    pairs: int = 256


CONFIGS = {
    # The configuration of the issue: a 58M-parameter Llama, 20-120-word prompts, 10-150-word completions.
    "58m": BenchConfig("58m"),
    # Same model, prompts 4x the completions (mean 160 vs 40 words): the shared prompt matters more.
    "long-prompt": BenchConfig("long-prompt", prompt_words=(80, 240), completion_words=(10, 70), pairs=128),
    # ~1.1B parameters (TinyLlama's shape), for the cache-hit start-up time only.
    "1b": BenchConfig("1b", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, pairs=16),
    # The GPU configuration of the layout issue: the same 1.1B Llama, sequences up to 2048 tokens
    # (the tokenizer makes one token per word here): prompts 1,100-1,400, completions 500-640.
    "1b-2048": BenchConfig("1b-2048", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, prompt_words=(1100, 1400),
                           completion_words=(500, 640), pairs=256),
}

TOKENIZER_VOCAB = 8000  # trained size (the BPE saturates below it on the generated corpus); <= the model's


def inputs_dir(cfg: BenchConfig, pairs: int, root: Path | None = None) -> Path:
    return (root or BENCH_DIR / "work") / f"{cfg.name}-{pairs}"


def make_rows(cfg: BenchConfig, pairs: int, seed: int = 0) -> list[dict]:
    from dpocache.tiny import _WORDS

    rng = random.Random(seed)

    def words(lo_hi: tuple[int, int]) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*lo_hi)))

    rows = []
    for i in range(pairs):
        rows.append({"prompt": f"question {i}: " + words(cfg.prompt_words),
                     "chosen": " " + words(cfg.completion_words),
                     "rejected": " " + words(cfg.completion_words)})
    return rows


def build_inputs(cfg: BenchConfig, pairs: int, root: Path | None = None, seed: int = 0) -> Path:
    """``<root>/<config>-<pairs>/{model/, data.jsonl, info.json}``; reused when already built."""
    out = inputs_dir(cfg, pairs, root)
    info_path = out / "info.json"
    if info_path.exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.data import write_jsonl
    from dpocache.tiny import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    del model
    write_jsonl(make_rows(cfg, pairs, seed), out / "data.jsonl")
    info = {"config": asdict(cfg), "pairs": pairs, "parameters": n_params, "tokenizer_vocab": len(tokenizer)}
    info_path.write_text(json.dumps(info, indent=1))
    return out


def bench_pairs(name: str, limit: int | None = None) -> tuple[Path, list]:
    """The model directory of configuration ``name`` and its tokenized pairs (the first
    ``limit``; all by default), built on first use."""
    from dpocache.cache_cli import load_tokenizer
    from dpocache.data import load_preference_data

    cfg = CONFIGS[name]
    inputs = build_inputs(cfg, cfg.pairs)
    tokenizer = load_tokenizer(inputs / "model")
    data = load_preference_data(str(inputs / "data.jsonl"), tokenizer, None, None, False, show_progress=False)
    return inputs / "model", data.pairs[:limit]


def write_results(name: str, summary: dict, runs: dict) -> Path:
    """``bench/results/<name>-<time>.json``: the summary and every run; prints the summary."""
    out = BENCH_DIR / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return out
