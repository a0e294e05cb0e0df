"""``dpocache.integrations.trl_grpo.CachedGRPOTrainer`` against TRL 1.16's own GRPOTrainer on a
tiny Llama (fp32, CPU), on the demo's sorting prompts: the same seed gives the same completions,
so the reference values, the logged ``kl`` and the ``loss`` are compared step by step. Skipped
when TRL is not installed (``pip install 'dpocache[trl]'``).

Run as a script (``torchrun ... test_trl_grpo.py MODEL_DIR OUT``), this file is the worker of the
two-process test: each rank checks its own reference values against TRL's computation."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from train_fixtures import one_thread  # noqa: E402,F401

from dpocache.models import reference as reference_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
ATOL, RTOL = 1e-5, 2e-6  # fp32 rounding between two kernels' orders of summation
TEMPERATURE = 0.7  # not 1: TRL divides the reference's logits by it, and so must the service


def _args(out: Path, **extra):
    from trl import GRPOConfig

    settings = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0,
                    beta=0.04, learning_rate=1e-3, lr_scheduler_type="constant", temperature=TEMPERATURE,
                    save_strategy="no", disable_tqdm=True)
    return GRPOConfig(**{**settings, **extra})


def _dataset(n: int = 48):
    from datasets import Dataset

    from dpocache.training.demo import sorting_pairs

    return Dataset.from_list([{"prompt": row["prompt"]} for row in sorting_pairs(n, seed=3)])


def count_numbers(completions, **_):
    return [float(len(re.findall(r"\d+", c))) for c in completions]


def _policy(model_dir: Path):
    """The tiny model, stopping also at any number token: completions of varied lengths, so
    that their right padding (and the prompts' left padding) is exercised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    numbers = [i for t, i in tokenizer.get_vocab().items() if t.lstrip("Ġ").isdigit()]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *sorted(numbers)]
    return model, tokenizer


def _run(cls, model_dir: Path, out: Path, steps: int = STEPS, model=None, train: bool = True, args=None, **kwargs):
    """(trainer, the output of every ``_generate_and_score_completions`` call) after ``steps``."""
    policy, tokenizer = _policy(model_dir)
    trainer = cls(model=model if model is not None else policy, reward_funcs=count_numbers,
                  args=args or _args(out, max_steps=steps), train_dataset=_dataset(), processing_class=tokenizer,
                  **kwargs)
    outputs = []
    scored = trainer._generate_and_score_completions

    def keep(inputs):
        outputs.append(scored(inputs))
        return outputs[-1]

    trainer._generate_and_score_completions = keep
    if train:
        trainer.train()
    return trainer, outputs


def _logged(trainer, key: str) -> list[float]:
    return [r[key] for r in trainer.state.log_history if key in r and "train_runtime" not in r]


def _assert_equal_to_trl(ours, theirs, steps: int = STEPS):
    """The same completions each step, TRL's reference values within fp32 rounding (0 at
    padding, as TRL's), and the logged kl and loss within 1e-5."""
    (mine, mine_out), (trl, trl_out) = ours, theirs
    assert len(mine_out) == steps
    for step, (a, b) in enumerate(zip(mine_out, trl_out)):
        assert torch.equal(a["completion_ids"], b["completion_ids"]), f"step {step}: other completions"
        torch.testing.assert_close(a["ref_per_token_logps"], b["ref_per_token_logps"], atol=ATOL, rtol=RTOL)
        assert not a["ref_per_token_logps"][a["completion_mask"] == 0].any()
    for key in ("kl", "loss"):
        got, want = _logged(mine, key), _logged(trl, key)[:steps]
        assert len(got) == steps and max(abs(x - y) for x, y in zip(got, want)) <= 1e-5, (key, got, want)
    assert max(_logged(mine, "kl")) > 1e-4  # the policy moved: the KL says something


@pytest.fixture(scope="module")
def trl_full(tmp_path_factory, model_dir):
    from trl import GRPOTrainer

    return _run(GRPOTrainer, model_dir, tmp_path_factory.mktemp("trl-full"))


def test_batches_have_padding_on_both_sides(trl_full):
    """What makes the comparisons below worth it: prompts of several lengths (left padding),
    completions of several lengths (right padding), in the same batch."""
    widths = [(o["prompt_mask"].sum(1).unique().numel(), o["completion_mask"].sum(1).unique().numel())
              for o in trl_full[1]]
    assert any(p > 1 and c > 1 for p, c in widths), widths


@pytest.mark.parametrize("kind", ["none", "directory", "streamed", "service"])
def test_full_finetuning_equals_grpotrainer(trl_full, model_dir, tmp_path, kind):
    """reference=None (TRL's: the policy's starting weights), its directory (its layers
    streamed from host memory, or not), or a ReferenceService: TRL's values, kl and loss over 5
    steps with the same seed."""
    from dpocache.integrations.trl_grpo import CachedGRPOTrainer
    from dpocache.service import ReferenceService

    reference = {"none": None, "directory": model_dir, "streamed": model_dir}.get(kind) if kind != "service" else \
        ReferenceService.from_pretrained(model_dir, "float32", "cpu", temperature=TEMPERATURE)
    ours = _run(CachedGRPOTrainer, model_dir, tmp_path, reference=reference, reference_stream=kind == "streamed")
    assert ours[0].ref_model is ours[0].dpocache_reference  # TRL holds no reference weights
    streamed = ours[0].dpocache_reference.train.reference.streamed if kind != "service" else None
    assert (streamed is not None) == (kind == "streamed")
    _assert_equal_to_trl(ours, trl_full)
    stats = ours[0].dpocache_reference.stats()
    assert stats["trainer_calls"] == STEPS and stats["prompt_tokens_saved"] > 0  # each group's prompt ran once


def test_lora_equals_grpotrainer(model_dir, tmp_path):
    """A fresh LoRA (peft_config=): the reference is the adapter-disabled base, as TRL's."""
    from peft import LoraConfig
    from trl import GRPOTrainer

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    lora = dict(peft_config=LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    theirs = _run(GRPOTrainer, model_dir, tmp_path / "trl", **lora)
    ours = _run(CachedGRPOTrainer, model_dir, tmp_path / "ours", **lora)
    assert ours[0].dpocache_reference.train.reference.adapter_disabled
    _assert_equal_to_trl(ours, theirs)


def test_trained_adapter_needs_its_directory_then_equals_trls_frozen_copy(model_dir, tmp_path):
    """A PeftModel whose adapter is trained: TRL's reference is a frozen copy of that adapter
    (not the base), so reference=None is refused in one line; its directory gives TRL's values."""
    from peft import AutoPeftModelForCausalLM
    from test_reference_initial import make_adapter
    from trl import GRPOTrainer

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    adapter = make_adapter(model_dir, tmp_path / "sft-lora")

    def peft_model():
        model = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32, is_trainable=True)
        model.generation_config.eos_token_id = _policy(model_dir)[0].generation_config.eos_token_id
        return model

    with pytest.raises(ValueError, match="adapter already changes its outputs .*pass reference= the adapter's") as e:
        _run(CachedGRPOTrainer, model_dir, tmp_path / "refused", model=peft_model(), train=False)
    assert "\n" not in str(e.value)
    theirs = _run(GRPOTrainer, model_dir, tmp_path / "trl", steps=2, model=peft_model())
    ours = _run(CachedGRPOTrainer, model_dir, tmp_path / "ours", steps=2, model=peft_model(), reference=adapter)
    _assert_equal_to_trl(ours, theirs, steps=2)


def test_beta_zero_is_grpotrainer_and_loads_no_reference(model_dir, tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    def refuse(*args, **kwargs):
        raise AssertionError("a reference was loaded with beta=0")

    monkeypatch.setattr(reference_mod.ReferenceModel, "from_pretrained", refuse)
    monkeypatch.setattr(reference_mod.ReferenceModel, "__init__", refuse)
    args = lambda out: _args(out, beta=0.0, max_steps=2)  # noqa: E731
    ours, _ = _run(CachedGRPOTrainer, model_dir, tmp_path, args=args(tmp_path / "ours"), reference=model_dir)
    theirs, _ = _run(GRPOTrainer, model_dir, tmp_path, args=args(tmp_path / "trl"))
    assert ours.ref_model is None and ours.dpocache_reference is None
    assert _logged(ours, "loss") == _logged(theirs, "loss")


def test_the_reference_runs_the_models_own_kernels(model_dir, tmp_path, reference_kernels_asked):
    """Liger's kernels (``--kernels auto`` elsewhere, on a GPU) are never applied to the reference
    beside TRL's policy: its RoPE patch replaces the model module's function for the process."""
    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    _run(CachedGRPOTrainer, model_dir, tmp_path, steps=1, train=False, reference=model_dir)
    assert reference_kernels_asked == ["none"]


def _swapped_tokenizer(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with two tokens of its tokenizer swapped: same size, other ids."""
    import shutil

    shutil.copytree(model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġof"] = vocab["Ġof"], vocab["Ġthe"]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_mistakes_are_refused_before_the_first_step_in_one_line(model_dir, tmp_path, tokenizer):
    """Another tokenizer (a directory, or a service loaded from one), another vocabulary,
    another temperature: a ValueError naming what differs, at construction."""
    from dpocache.integrations.trl_grpo import CachedGRPOTrainer
    from dpocache.models.tiny import build_model
    from dpocache.service import ReferenceService

    wider = ReferenceService(build_model("llama", tokenizer, vocab_size=len(tokenizer) + 64), temperature=TEMPERATURE)
    other = _swapped_tokenizer(model_dir, tmp_path / "other-tokenizer")
    cases = {
        "reference's tokenizer .* differs from the policy's: 5\\d\\d tokens against 5\\d\\d, first difference":
            other,
        # a service given, loaded from that directory: the same vocabulary size, so only its tokenizer tells
        "reference's tokenizer .*other-tokenizer.* differs from the policy's":
            ReferenceService.from_pretrained(other, "float32", "cpu", temperature=TEMPERATURE),
        "reference's vocabulary has 5\\d\\d tokens, the policy's 5\\d\\d": wider,
        "ReferenceService divides its logits by temperature 1, the trainer by args.temperature=0.7":
            ReferenceService.from_pretrained(model_dir, "float32", "cpu"),
    }
    for message, reference in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            _run(CachedGRPOTrainer, model_dir, tmp_path / "refused", reference=reference, train=False)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="sync_ref_model=True"):
        _run(CachedGRPOTrainer, model_dir, tmp_path, args=_args(tmp_path, sync_ref_model=True), train=False)
    # TRL's default max_completion_length (512) on a model of 512 positions: no prompt fits beside it
    with pytest.raises(ValueError, match="args.max_completion_length=512 leaves no room for a prompt in the "
                                         "reference's context \\(512 positions"):
        _run(CachedGRPOTrainer, model_dir, tmp_path, args=_args(tmp_path, max_completion_length=512), train=False)
    with pytest.raises(ValueError, match="reference_stream=True streams a reference this trainer loads"):
        _run(CachedGRPOTrainer, model_dir, tmp_path, reference_stream=True, train=False)
    with pytest.raises(ValueError, match="cache must be one of never, eval, always"):
        _run(CachedGRPOTrainer, model_dir, tmp_path, cache="sometimes", train=False)


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_trainers_own_arguments_are_refused_before_trl_whatever_beta(model_dir, tmp_path, monkeypatch, caplog,
                                                                        beta):
    """Each was accepted with beta=0, and with beta>0 refused only after TRL's constructor (a bad
    dtype), once the reference loaded (a budget of 0) or at the first evaluation (a cache
    directory under a file: a 63-line traceback). With beta=0 the arguments given are named as
    not used."""
    from trl import GRPOTrainer

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    afile = tmp_path / "afile"
    afile.write_text("")
    sub = re.escape(str(afile / "sub"))
    cases = [(dict(reference_dtype="fp32"), r"reference_dtype must be one of float32, bfloat16, float16 \(None: TRL"),
             (dict(reference_dtype="auto"), "reference_dtype must be one of"),
             (dict(reference_max_tokens=0), "reference_max_tokens must be a whole number of at least 1"),
             (dict(cache="bogus"), "cache must be one of never, eval, always; got 'bogus'"),
             (dict(reference_stream="yes"), "reference_stream must be True or False"),
             (dict(cache="eval", cache_dir=afile / "sub"),
              rf"cache_dir {sub}: cannot write there \(.*\) \(cache='eval' writes the look-aside cache there\)$"),
             (dict(reference=object()), "reference must be None, a model directory or Hub id, a ReferenceService"),
             # a directory given and never written: the default cache is 'never'
             (dict(cache_dir=tmp_path / "cache"), r"cache_dir is where cache='eval' or cache='always' keeps the "
                                                  r"look-aside cache, and cache is 'never' \(the default\)")]
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: pytest.fail("TRL was reached"))
    for kwargs, line in cases:
        with pytest.raises(ValueError, match=f"^CachedGRPOTrainer: {line}") as raised:
            CachedGRPOTrainer(model=None, reward_funcs=count_numbers, args=_args(tmp_path, beta=beta), **kwargs)
        assert "\n" not in str(raised.value)
    if beta == 0.0:
        monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: None)
        with caplog.at_level("WARNING", logger="dpocache.integrations.trl_grpo"):
            CachedGRPOTrainer(model=None, reward_funcs=count_numbers, args=_args(tmp_path, beta=0.0),
                              reference=model_dir, cache="eval", reference_max_tokens=64)
        assert "beta=0, so no reference runs and reference, cache, reference_max_tokens are not used" in caplog.text


def test_a_prompt_with_no_room_for_a_completion_is_refused_before_the_first_step(model_dir, tmp_path, monkeypatch):
    """A dataset prompt that, with ``max_completion_length``, passes the reference's 512 positions
    is named at construction, where the step that sampled it would have stopped the run; plain and
    chat prompts are measured as TRL tokenizes them, and only those whose bytes leave a doubt."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    policy, tokenizer = _policy(model_dir)
    tokenized = []
    tokenize = GRPOTrainer._tokenize_prompts
    monkeypatch.setattr(GRPOTrainer, "_tokenize_prompts",
                        lambda self, prompts: tokenized.extend(prompts) or tokenize(self, prompts))
    prompts = [r["prompt"] for r in _dataset(40)]
    long, longer = "sort " * 502 + "the list", "sort " * 505 + "the list"
    prompts[30], prompts[35] = long, longer
    n, m = (len(tokenizer(text=p)["input_ids"]) for p in (long, longer))
    assert 504 < n < m < 512
    with pytest.raises(ValueError) as e:
        CachedGRPOTrainer(model=policy, reward_funcs=count_numbers, args=_args(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    assert str(e.value) == (
        f"CachedGRPOTrainer: train_dataset row 30's prompt is {n} tokens, so with args.max_completion_length=8 a "
        f"sample could reach {n + 8}, past the reference's context (512 positions, from its config), which it "
        f"refuses to score past; 2 prompts are over 504 tokens, the longest {m}: drop them, or set "
        f"max_completion_length to at most {512 - m}")
    assert tokenized == [long, longer]  # the other 38 fit by their bytes alone

    # a chat prompt in an evaluation set: the template's tokens count too
    chat = [{"role": "user", "content": "sort " * 250}]
    k = len(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"])
    assert k > 250 + 2
    evaluation = {"sorting": Dataset.from_dict({"prompt": [[{"role": "user", "content": "sort 3 1 2"}], chat]})}
    refused = (f"eval_dataset\\['sorting'\\] row 1's prompt is {k} tokens, so with args.max_completion_length="
               f"{512 - k + 1} a sample could reach 513, .*; 1 prompt is over {k - 1} tokens, the longest {k}: drop "
               f"it, or set max_completion_length to at most {512 - k}$")
    with pytest.raises(ValueError, match=refused):
        CachedGRPOTrainer(model=policy, reward_funcs=count_numbers,
                          args=_args(tmp_path, max_completion_length=512 - k + 1), train_dataset=_dataset(8),
                          eval_dataset=evaluation, processing_class=tokenizer)
    trainer = CachedGRPOTrainer(model=policy, reward_funcs=count_numbers,
                                args=_args(tmp_path, max_completion_length=512 - k),
                                train_dataset=_dataset(8), eval_dataset=evaluation, processing_class=tokenizer)
    # the bound that spares the tokenizer is one: at least the token count, here on unusual text too
    odd = ["", " ", "12 3 4 567 89", "naïve café ÷ ∑ 数字 🙂🙂", "\n\t  trailing  ", "<unk>" * 3, long]
    for batch in (odd, [[{"role": "user", "content": t}] for t in odd]):
        bounds, lengths = trainer._prompt_bytes(batch), [len(x) for x in tokenize(trainer, batch)[0]]
        assert all(b >= n for b, n in zip(bounds, lengths)), (bounds, lengths)


def test_evaluation_uses_the_look_aside_cache_training_does_not(model_dir, tmp_path, monkeypatch):
    """cache='eval': sampled training completions are not stored; evaluation's are, so an
    evaluation that samples the same completions again is answered from the cache. By default
    (cache='never', as TRL samples in evaluation too) nothing is written. ``stats()`` counts
    evaluation apart, and TRL's logs get the reference's seconds."""
    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    args = _args(tmp_path / "out", max_steps=1, per_device_eval_batch_size=8)
    trainer, _ = _run(CachedGRPOTrainer, model_dir, tmp_path, args=args, cache_dir=tmp_path / "cache",
                      eval_dataset=_dataset(8), cache="eval")
    reference = trainer.dpocache_reference
    assert reference.train.store is None and not any((tmp_path / "cache").iterdir())  # made writable, empty
    counts = []
    for _ in range(2):
        torch.manual_seed(5)  # the same sampled completions both times
        trainer.evaluate()
        counts.append((reference.eval.stats()["sequences"], reference.eval.stats()["cache_hits"]))
    assert reference.eval.store is not None and counts[0][0] == 32 and counts[0][1] < 32  # 8 prompts x 4
    assert counts[1] == (64, counts[0][1] + 32), counts  # the second evaluation: all from the cache
    stats = reference.stats()
    assert (stats["trainer_calls"], stats["sequences"], stats["cache_hits"]) == (1, 8, 0)  # training: 2 prompts x 4
    assert (stats["eval"]["sequences"], stats["eval"]["cache_hits"]) == counts[1] and stats["eval"]["trainer_calls"]
    assert _logged(trainer, "reference/seconds")[0] > 0
    assert [r["eval_reference/seconds"] > 0 for r in trainer.state.log_history if "eval_loss" in r] == [True, True]

    monkeypatch.setenv("DPOCACHE_CACHE_DIR", str(tmp_path / "default"))
    default, _ = _run(CachedGRPOTrainer, model_dir, tmp_path, args=args, eval_dataset=_dataset(8))
    default.evaluate()
    assert default.dpocache_reference.stats()["eval"]["trainer_calls"] and not (tmp_path / "default").exists()


@pytest.mark.slow
def test_reference_pool_in_another_process_equals_grpotrainer(trl_full, model_dir, tmp_path):
    """A ReferencePool (a Ray replica in its own process): TRL's values; one at another
    temperature, and one whose directory's tokenizer is not the policy's (the same size, two
    tokens swapped), are refused before TRL loads anything."""
    ray = pytest.importorskip("ray")
    from dpocache.integrations.trl_grpo import CachedGRPOTrainer
    from dpocache.service import ReferencePool

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        pool = ReferencePool(model_dir, num_replicas=1, dtype="float32", device="cpu", temperature=TEMPERATURE)
        ours = _run(CachedGRPOTrainer, model_dir, tmp_path, steps=2, reference=pool)
        _assert_equal_to_trl(ours, trl_full, steps=2)
        # the policy's tokenizer, not the pool's: the vocabulary sizes agree, only the tokenizers tell
        other = _swapped_tokenizer(model_dir, tmp_path / "other-tokenizer")
        pools = re.escape(f"reference's tokenizer ({model_dir}) differs from the policy's")
        with pytest.raises(ValueError, match=pools):
            _run(CachedGRPOTrainer, other, tmp_path, reference=pool, train=False)
        pool.temperature = 1.0  # as a pool built without temperature= says
        with pytest.raises(ValueError, match="ReferencePool divides its logits by temperature 1, the trainer"):
            _run(CachedGRPOTrainer, model_dir, tmp_path, reference=pool, train=False)
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_two_processes_each_rank_scores_its_own_share_right(model_dir, tmp_path):
    """torchrun, 2 CPU processes on gloo: each rank's reference values are what TRL's own
    computation gives for that rank's batch, and the ranks had different batches."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="",  # the worker imports tests/train_fixtures.py, as this module does
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    with socket.socket() as s:  # a free port: torchrun's static rendezvous takes no port 0
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), __file__, str(model_dir), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2 and r["batches"] == 2 and r["max_abs_diff"] <= ATOL, r
        assert r["close"], r
    assert ranks[0]["prompts"] != ranks[1]["prompts"]


def _rank_worker(model_dir: str, out: str) -> None:
    """One rank of the two-process test: 2 steps of CachedGRPOTrainer, then every batch's
    reference values compared with TRL's own ``_get_per_token_logps_and_entropies`` on a
    reference loaded as TRL loads it, with its fused head at the trainer's temperature."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    torch.set_num_threads(1)
    args = _args(Path(out) / "run", max_steps=2, per_device_train_batch_size=4)
    trainer, outputs = _run(CachedGRPOTrainer, Path(model_dir), Path(out), steps=2, args=args)
    reference, _ = _policy(Path(model_dir))
    reference.eval()
    add_fused_lm_head(reference, temperature=TEMPERATURE)
    diffs, close, prompts = [], True, []
    for o in outputs:
        ids = torch.cat([o["prompt_ids"], o["completion_ids"]], 1)
        mask = torch.cat([o["prompt_mask"], o["completion_mask"]], 1)
        with torch.no_grad():
            want, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, reference, ids, mask,
                                                                         o["completion_ids"].shape[1])
        diffs.append(float((want - o["ref_per_token_logps"]).abs().max()))
        close &= torch.allclose(o["ref_per_token_logps"], want, atol=ATOL, rtol=RTOL)
        prompts.append(o["prompt_ids"].tolist())
    rank = trainer.accelerator.process_index
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "world_size": trainer.accelerator.num_processes, "batches": len(outputs), "max_abs_diff": max(diffs),
        "close": bool(close), "prompts": prompts}))


@pytest.mark.slow
def test_example_runs_to_the_end(tmp_path):
    """examples/trl_grpo.py with its defaults (its output folder moved here), as a user runs it:
    the KL starts at 0 and rises; the reference's prompt sharing is reported."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    kl = [float(r[2]) for r in rows]
    assert len(kl) == 20 and kl[0] < 1e-5 and max(kl[1:]) > 1e-4, done.stdout
    assert "prompt tokens saved by sharing" in done.stdout.splitlines()[-1]


def test_other_trl_versions_fail_clearly():
    from dpocache.integrations.trl_grpo import check_trl_version

    with pytest.raises(RuntimeError, match="CachedGRPOTrainer supports TRL 1.16.x; found TRL 0.19.1"):
        check_trl_version("0.19.1")


def test_package_surface():
    import dpocache
    from dpocache.integrations import trl as trl_integration
    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    assert dpocache.CachedGRPOTrainer is CachedGRPOTrainer
    assert trl_integration.CachedGRPOTrainer is CachedGRPOTrainer
    assert "CachedGRPOTrainer" in dir(dpocache)


if __name__ == "__main__":  # a rank of test_two_processes_each_rank_scores_its_own_share_right
    _rank_worker(*sys.argv[1:3])
