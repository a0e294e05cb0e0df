"""Completion log-probs of sequences: the model's body once, the head on completion positions
only (``logprobs``), in the padded, shared-prompt and packed layouts (``layouts``: one switch;
``layout_choice``: which one runs), with their attention backends, GRPO groups, compiled layers
and the bf16 matrix products."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.scoring.logprobs": ["CompletionLogProbs", "unwrap_causal_lm", "autocast"],
    "dpocache.scoring.layout_choice": ["LayoutChoice", "select_layout", "LAYOUTS"],
    "dpocache.scoring.layouts": ["policy_logps"],
    "dpocache.scoring.padded": ["PairBatch", "collate_pairs"],
    "dpocache.scoring.shared": ["SharedPromptBatch", "collate_shared", "collate_packed"],
    "dpocache.scoring.groups": [
        "Group", "GroupBatch", "collate_groups", "SequenceBatch", "collate_sequences", "per_sequence"
    ],
})
