"""DPO-family preference losses: the pure formulas (``formulas``), their registry and the loss
specs that combine them (``registry``), and the per-token modifiers LD-DPO (``ld_dpo``) and WPO
(``wpo``) apply in training."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.losses.formulas": [
        "LossOutput", "DEFAULT_BETA", "sigmoid_loss", "hinge_loss", "ipo_loss", "exo_pair_loss",
        "nca_pair_loss", "robust_loss", "bco_pair_loss", "sppo_hard_loss", "aot_loss", "aot_unpaired_loss",
        "apo_zero_loss", "apo_down_loss", "discopop_loss", "sigmoid_norm_loss", "dpo_norm_loss", "simpo_loss",
        "orpo_loss", "sft_loss", "F_DIVERGENCES", "f_divergence_scores", "ld_sequence_logps", "ld_pair_logps",
        "wpo_token_logps", "wpo_weights",
    ],
    "dpocache.losses.registry": [
        "LossFn", "LOSSES", "GLOBAL_DEFAULTS", "LossSpec", "parse_loss_spec", "needs_reference", "check_loss_values",
        "check_params_read", "preference_loss",
    ],
})
