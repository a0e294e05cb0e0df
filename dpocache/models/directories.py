"""What a model directory holds: a full model, or a PEFT adapter whose base is another
directory or a Hub id in the local Hugging Face cache; and which weights the reference is."""

from __future__ import annotations

import json
from pathlib import Path

from dpocache.models.hub_ids import local_base_dir

REFERENCES = ("initial", "base")  # model.reference / --reference


def adapter_base_dir(model_path: str | Path) -> Path | None:
    """The base model directory of a PEFT adapter directory; None for a full model directory."""
    adapter_config = Path(model_path) / "adapter_config.json"
    if not adapter_config.exists():
        return None
    fields = json.loads(adapter_config.read_text())
    base = local_base_dir(fields.get("base_model_name_or_path"), fields.get("revision"))
    if base is None:
        raise FileNotFoundError(f"{adapter_config}: base_model_name_or_path '{fields.get('base_model_name_or_path')}' "
                                "is neither a local directory nor a Hub id in the local Hugging Face cache")
    return base


def reference_weights_dir(model_path: str | Path) -> Path:
    """The directory holding the full model weights: an adapter directory's base, else itself."""
    return adapter_base_dir(model_path) or Path(model_path)


def reference_source(model_path: str | Path, reference: str = "initial") -> tuple[Path, Path | None]:
    """(base weights directory, adapter directory or None) of the reference model.

    ``initial``: the model ``model_path`` describes, as the policy starts from it (a PEFT
    adapter directory is its base with that adapter on, frozen, as TRL's frozen copy of a
    loaded adapter). ``base``: an adapter directory's bare base (the adapter off)."""
    if reference not in REFERENCES:
        raise ValueError(f"model.reference (--reference) must be one of {', '.join(REFERENCES)}; got '{reference}'")
    base = adapter_base_dir(model_path)
    if base is None:
        return Path(model_path), None
    return base, (Path(model_path) if reference == "initial" else None)


# adapter_config.json fields that do not change the adapter's numbers (where the base was read
# from is covered by the base's own fingerprint).
