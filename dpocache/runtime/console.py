"""A quiet console: in a normal run only dpocache's own lines and one progress bar per phase.

transformers, datasets and the Hugging Face Hub print progress bars of their own ("Loading
weights", "Writing model shards", "Map") and warnings between dpocache's; ``quiet_libraries``
turns them off through the environment variables each library reads at import, before any of
them is imported, so torchrun's workers (which inherit the environment) are quiet too. With
``-v`` they stay on. A variable the user set is left as it is. ``three_places`` writes a
summary's figures.
"""

from __future__ import annotations

import os
import warnings

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # the Hub's bars; transformers' follow them
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
QUIET_MODULES = ("transformers", "datasets", "huggingface_hub", "peft")


def quiet_libraries(verbose: bool = False) -> None:
    """Silence the libraries' bars and warnings for this process and its children (not with ``verbose``)."""
    if verbose:
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for module in QUIET_MODULES:
        warnings.filterwarnings("ignore", module=rf"{module}(\..*)?$")


def three_places(x: float) -> str:
    """``x`` to 3 decimals; a value that rounds to zero is 0.000 whatever its sign (a margin of
    -1e-9 at step 0, where the policy is the reference, read -0.000)."""
    text = f"{x:.3f}"
    return text[1:] if text == "-0.000" else text
