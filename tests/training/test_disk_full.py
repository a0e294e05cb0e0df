"""A full disk while a checkpoint (or the final model) is written: one line saying what failed,
where, about how much space it needs and which complete checkpoint is kept, exit status 1; the
half-written ``.tmp`` directory is removed and ``--resume`` continues from the kept checkpoint.

safetensors reports a full disk as its own ``SafetensorError`` ("... No space left on device (os
error 28)"), not an ``OSError``, so the command line's ``disk_errors`` let it through as a
traceback. Runs go through the command line in-process (``dpocache.cli.entry.main``), with the
write that fails patched to raise exactly what safetensors or the OS raises."""

from __future__ import annotations

import errno
import json
import os

import pytest
from safetensors import SafetensorError
from train_fixtures import base_model, flags, load_tensors, one_thread, train_jsonl  # noqa: F401

from dpocache.cli.entry import main
from dpocache.models import checkpoint as checkpoint_mod
from dpocache.models.checkpoint import STATE_FILE, _model_bytes
from dpocache.runtime.preflight import disk_errno

# What safetensors 0.4-0.8 raises when the disk fills mid-write (seen on a full tmpfs).
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _train(capsys, model, data, out, cache, *extra) -> tuple[int, str]:
    code = main(["train", *flags(model, data, out, cache, *extra)])
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    """The one line of stderr besides the progress bars transformers draws in-process and the
    run's own line of its steps and batch, said before the first step."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines()
             if line.strip() and "it/s]" not in line and not line.startswith("train: ")]
    assert len(lines) == 1, err
    return lines[0]


def _checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_full_disk_at_the_second_checkpoint_keeps_the_first_and_resume_works(
        tmp_path, capsys, monkeypatch, base_model, train_jsonl):
    out, cache = tmp_path / "run", tmp_path / "cache"
    real_save = checkpoint_mod.save_file
    calls = []

    def fills_up(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint's optimizer state: half of it written, then the disk is full
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise SafetensorError(FULL)
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_mod, "save_file", fills_up)
    code, err = _train(capsys, base_model, train_jsonl, out, cache, "--max-steps", "3", "--save-steps", "1")
    line = _one_line(err)
    assert code == 1, err
    first = out / "checkpoints" / "step-000001"
    tmp = out / "checkpoints" / "step-000002.tmp"
    assert line.startswith(f"dpocache train: error: cannot write checkpoint step-000002 to {tmp}: No space left on "
                           "device; it needs about "), line
    assert "(as step-000001 took)" in line and "is free there" in line, line
    assert f"the last complete checkpoint, {first}, is kept: make room and continue with --resume" in line, line
    # The partial checkpoint is gone (it held space, and is never read); the complete one is whole.
    assert _checkpoints(out) == ["step-000001"]
    assert json.loads((first / STATE_FILE).read_text())["step"] == 1
    assert load_tensors(first / "model.safetensors") and load_tensors(first / "optimizer.safetensors")

    monkeypatch.setattr(checkpoint_mod, "save_file", real_save)  # room made
    code = main(["train", *flags(base_model, train_jsonl, out, cache, "--max-steps", "3", "--save-steps", "1"),
                 "--resume"])
    stdout = capsys.readouterr().out
    assert code == 0 and f"resumed from {first} (step 1)" in stdout, stdout
    assert (out / "final" / "model.safetensors").exists()
    assert _checkpoints(out)[-1] == "step-000003"


def test_full_disk_at_the_first_checkpoint_estimates_the_space(tmp_path, capsys, monkeypatch, base_model,
                                                               train_jsonl):
    """No earlier checkpoint to measure: the estimate is the weights and the optimizer state.
    The error here is an OSError (the tokenizer's files), which was exit 2 and no estimate."""
    from transformers import PreTrainedTokenizerBase

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    out = tmp_path / "run"
    code, err = _train(capsys, base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "1")
    line = _one_line(err)
    assert code == 1, err
    assert "cannot write checkpoint step-000001" in line and "No space left on device" in line, line
    assert "(its weights and optimizer state, estimated)" in line, line
    assert "no complete checkpoint was written before this one" in line, line
    assert _checkpoints(out) == []


def test_a_read_only_final_directory_keeps_the_checkpoint(tmp_path, capsys, monkeypatch, base_model, train_jsonl):
    """The final model's write: one line, no space estimate for a read-only disk."""
    from transformers import PreTrainedTokenizerBase

    real = PreTrainedTokenizerBase.save_pretrained

    def read_only_final(self, directory, *args, **kwargs):
        if str(directory).endswith("final.tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(self, directory, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", read_only_final)
    out = tmp_path / "run"
    code, err = _train(capsys, base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "1")
    line = _one_line(err)
    assert code == 1, err
    assert f"cannot write the final model to {out / 'final.tmp'}: Read-only file system; the last complete " \
           f"checkpoint, {out / 'checkpoints' / 'step-000001'}, is kept" in line, line
    assert "needs about" not in line
    assert not (out / "final.tmp").exists() and not (out / "final").exists()


def test_disk_errno_reads_safetensors_errors():
    assert disk_errno(SafetensorError(FULL)) == errno.ENOSPC
    assert disk_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    assert disk_errno(SafetensorError("Error while deserializing header: header too large")) is None
    assert disk_errno(OSError(errno.ENOENT, "No such file or directory")) is None
    assert disk_errno(ValueError("No space left on device (os error 28)")) is None


@pytest.mark.parametrize("lora", [False, True])
def test_the_weights_estimate_is_what_save_pretrained_writes(tmp_path, base_model, lora):
    from dpocache.models.loading import load_causal_lm

    model = load_causal_lm(base_model)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path)
    (written,) = tmp_path.glob("*.safetensors")
    # The file adds its JSON header (about 100 bytes a tensor) to the tensors' bytes.
    assert _model_bytes(model) == pytest.approx(written.stat().st_size, rel=0.05, abs=4096)


def test_a_path_that_cannot_be_read_is_not_called_a_failed_write(tmp_path, monkeypatch):
    """A colleague's cache of umask 077: ``cache info`` said "cannot write to ...; what was saved
    before this is kept", though it writes nothing."""
    import errno
    import os

    from dpocache.runtime import preflight

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False)  # as another user (tests may run as root)
    with pytest.raises(preflight.UsageError) as err, preflight.disk_errors(cache_dir=tmp_path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(theirs))
    assert str(err.value) == (f"cannot read {theirs}: Permission denied (owner uid {os.getuid()}, mode 0700); ask its "
                              "owner to let the group read it (umask 002, or chmod -R g+rX)")
    # a file inside it, which cannot even be looked at (what `cache build` and `train` met first)
    inside, real_stat = theirs / "tokens" / "meta.json", os.stat

    def stat_outside_theirs(path):
        if str(path).startswith(str(theirs) + os.sep):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_stat(path)

    monkeypatch.setattr(preflight.os, "stat", stat_outside_theirs)
    with pytest.raises(preflight.UsageError, match=f"^cannot read {theirs}: Permission denied \\(owner uid"), \
            preflight.disk_errors(cache_dir=tmp_path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(inside))
    monkeypatch.setattr(preflight.os, "stat", real_stat)
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: True)  # readable: a write that failed
    with pytest.raises(preflight.UsageError, match="^cannot write to .*theirs: Permission denied; what was saved"), \
            preflight.disk_errors(cache_dir=tmp_path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(theirs))
