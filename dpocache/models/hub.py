"""Uploading a checkpoint to the Hugging Face Hub (where the network allows)."""

from __future__ import annotations

from pathlib import Path


class HubError(RuntimeError):
    pass


def push_folder(folder: Path, repo_id: str) -> str:
    """Upload ``folder`` to model repo ``repo_id``; a clear error when the Hub is unreachable
    or the token is missing. The local checkpoint is written first and is never at risk."""
    from huggingface_hub import HfApi  # deferred: its HTTP stack is only for a push (pyproject's ruff notes)

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="dpocache: final checkpoint")
    except Exception as e:  # network, auth and permission errors all come as different types
        raise HubError(f"could not push {folder} to the Hub repo '{repo_id}': {type(e).__name__}: {e}. "
                       f"The checkpoint is saved locally in {folder}; push it later with "
                       f"`hf upload {repo_id} {folder}`.") from None
    return str(info)
