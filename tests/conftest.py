"""Shared fixtures: a tokenizer, tiny models (in memory and saved with ``save_pretrained``) and
a generated preference data set. Everything is built offline and once per session."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Tests mirror the package (tests/<subpackage>/); a few import helpers of a test module in another
# folder (test_signals' signal points, test_reference_initial's adapter). Every folder is on the
# path, whichever test file a worker happens to import first.
for folder in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

# The tiny models run fastest on one thread, and several threads spin against each other on a
# small, busy machine (measured: a 96-pair build took 0.95 s on one thread and 5.8 s on two
# while other jobs ran). Subprocesses inherit the variable; set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Nothing a test runs reaches the user's own caches ($DPOCACHE_CACHE_DIR or ~/.cache/dpocache, the
# fingerprint memo of their own under $XDG_CACHE_HOME, datasets' ~/.cache/huggingface/datasets):
# a command run without --cache-dir writes its
# reference values and token stores, and datasets the tables its load_dataset prepares (the
# cache export tests read their parquet back so), into this process's own directory (each xdist
# worker has one; subprocesses inherit it), removed at exit.
_CACHE_DIR = tempfile.mkdtemp(prefix="dpocache-tests-cache-")
os.environ["DPOCACHE_CACHE_DIR"] = _CACHE_DIR
os.environ["HF_DATASETS_CACHE"] = os.path.join(_CACHE_DIR, "datasets")
os.environ["XDG_CACHE_HOME"] = os.path.join(_CACHE_DIR, "xdg")
atexit.register(shutil.rmtree, _CACHE_DIR, True)

# SIGINT as an interactive shell leaves it. A test run started in the background (nohup, or `&`
# in a script) inherits SIGINT ignored, and dpocache rightly leaves an ignored signal ignored
# (signals.stop_signals), so the stop-signal tests would test that path instead. A handler set
# here reaches subprocesses as SIGINT's default (exec resets a caught signal, not an ignored one).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise SIGHUP under nohup, which ignores it: a handler that does nothing keeps this process
# deaf to a hangup, as nohup asked, and subprocesses get SIGHUP's default, as the tests need.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

# Tests that run torch's compiler on the CPU (compiled layers, FlexAttention): torch 2.13 cannot
# link CPU kernels when it is installed under a path with a space (dpocache.scoring.compiling).
def _cpu_compile_blocked():
    from dpocache.scoring.compiling import cpu_compile_blocked

    return cpu_compile_blocked()


needs_cpu_compile = pytest.mark.skipif(_cpu_compile_blocked() is not None, reason=str(_cpu_compile_blocked()))

WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at which but have "
    "sort sorted list numbers answer question please order ascending model reward prompt cache "
    "token train step loss good bad yes"
).split()


def make_rows(n: int, seed: int = 0, min_prompt: int = 3, max_prompt: int = 24,
              max_completion: int = 18) -> list[dict]:
    """``n`` standard-format rows of varied lengths; every row is distinct (its number is in
    the prompt), so every row has its own key."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        prompt = f"row {seed}-{i}: " + words(rng.randint(min_prompt, max_prompt))
        chosen = " " + words(rng.randint(1, max_completion))
        rejected = " " + words(rng.randint(1, max_completion))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


@pytest.fixture(scope="session", name="make_rows")
def make_rows_fixture():
    """The ``make_rows`` function, for tests that generate their own rows."""
    return make_rows


@pytest.fixture(scope="session")
def tokenizer():
    from dpocache.models.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tokenizer):
    """``arch -> model`` built from config (fp32, eval mode); callers must not mutate them."""
    from dpocache.models.tiny import ARCHITECTURES, build_model

    models = {}
    for arch in ARCHITECTURES:
        m = build_model(arch, tokenizer)
        m.eval()
        models[arch] = m
    return models


def _save_model(out: Path, tokenizer, arch: str, seed: int) -> Path:
    from dpocache.models.tiny import build_model

    out.mkdir(parents=True, exist_ok=True)
    build_model(arch, tokenizer, seed=seed).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny llama with its tokenizer, saved as a Hugging Face model directory."""
    return _save_model(tmp_path_factory.mktemp("llama-seed0"), tokenizer, "llama", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory, tokenizer) -> Path:
    """Same architecture and config as ``model_dir``, different weights."""
    return _save_model(tmp_path_factory.mktemp("llama-seed1"), tokenizer, "llama", seed=1)


@pytest.fixture(scope="session")
def pref_rows() -> list[dict]:
    return make_rows(48)


@pytest.fixture(scope="session")
def pref_jsonl(tmp_path_factory, pref_rows) -> Path:
    from dpocache.data.rows import write_jsonl

    return write_jsonl(pref_rows, tmp_path_factory.mktemp("data") / "prefs.jsonl")


@pytest.fixture(scope="module")
def data(tokenizer, pref_jsonl):
    """The generated preference set, read and tokenized (``PreferenceData``)."""
    from dpocache.data.pairs import load_preference_data

    return load_preference_data(pref_jsonl, tokenizer, show_progress=False)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The saved tiny model as an fp32 CPU ``ReferenceModel``."""
    from dpocache.models.reference import ReferenceModel

    return ReferenceModel.from_pretrained(model_dir, "float32", device="cpu")


@pytest.fixture
def cli(capsys):
    """Run ``dpocache ARGS`` in-process; returns (exit code, stdout, stderr)."""
    from dpocache.cli.entry import main

    def run(*args):
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


# ``python -m pytest -m quick``: a subset that checks an install in about a minute on 2 cores
# (the README's quick command): the API and config, data, the losses against TRL's formulas, the
# cache, the layouts against the padded forward, the service, a training run and the demo. A file
# renamed away fails the collection here rather than shrink the subset in silence.
QUICK = (
    "test_api.py", "test_config.py", "test_docs.py", "losses/test_losses.py", "losses/test_losses_trl_options.py",
    "cache/test_cache.py", "cache/test_cache_namespace_pins.py", "data/test_data.py", "data/test_values.py",
    "scoring/test_logprobs.py", "scoring/test_prefix.py", "scoring/test_layouts.py", "service/test_service.py",
    "training/test_train.py", "cli/test_cache_cli.py", "e2e/test_demo.py",
)
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    missing = [name for name in QUICK if not (TESTS / name).is_file()]
    if missing:
        raise pytest.UsageError(f"conftest.QUICK names test files that do not exist: {', '.join(missing)}")
    quick = {str(TESTS / name) for name in QUICK}
    for item in items:
        if str(item.path) in quick:
            item.add_marker(pytest.mark.quick)


_FAMILY_ROPES: dict = {}  # transformers family module -> its own apply_rotary_pos_emb


@pytest.fixture(autouse=True)
def _family_rope_restored():
    """Each test ends with the transformers families' own RoPE: Liger's (a GPU test's
    ``--kernels auto``) replaces it for the whole process (dpocache.models.kernels), and would
    reach the next test's models, even those run with ``--kernels none``."""
    def record() -> None:
        for name, module in list(sys.modules.items()):
            rope = getattr(module, "apply_rotary_pos_emb", None) if name.startswith("transformers.models.") else None
            if rope is not None and module not in _FAMILY_ROPES and rope.__module__.startswith("transformers."):
                _FAMILY_ROPES[module] = rope

    record()
    yield
    record()  # the families first imported during the test, before any patch
    for module, rope in _FAMILY_ROPES.items():
        module.apply_rotary_pos_emb = rope


@pytest.fixture
def reference_kernels_asked(monkeypatch) -> list[str]:
    """The ``kernels`` each ``ReferenceModel.from_pretrained`` call of the test asks for, in order
    (the model still loads)."""
    from dpocache.models.reference import ReferenceModel

    real, asked = ReferenceModel.from_pretrained.__func__, []

    def spied(cls, *args, **kwargs):
        asked.append(kwargs.get("kernels", "auto"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(ReferenceModel, "from_pretrained", classmethod(spied))
    return asked


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one process (FSDP2 needs a group, even of one; DDP wraps in one)."""
    import torch.distributed as dist

    from dpocache.distributed.process_group import DistEnv

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _stop_signal_handlers_restored():
    """Each test ends with the stop signals' handlers it started with. ``dpocache.cli.main`` ignores
    them once a signal stopped it (``ignore_stop_signals``: a process that is exiting), which in a
    test that calls it in-process would reach every later test of the worker, and, as an ignored
    signal is inherited through exec, every subprocess it starts: a torchrun worker sent SIGUSR1
    then went on as if nothing had arrived."""
    from dpocache.runtime.signals import STOP_SIGNALS

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
