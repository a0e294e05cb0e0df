"""Preference data: rows read and their columns mapped (``rows``), checked and rendered to text
(``render``), tokenized, truncated and keyed (``pairs``); a batch of pairs' values as one record
(``values``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.data.rows": [
        "DataError", "RawRow", "read_rows", "map_columns", "write_jsonl", "STANDARD_COLUMNS", "TEMPLATE_COLUMNS",
    ],
    "dpocache.data.render": ["check_text", "template_inputs", "render_conversation"],
    "dpocache.data.pairs": [
        "TokenizedPair", "SkippedRow", "PreferenceData", "example_key", "truncate_pair", "tokenize_rows",
        "load_preference_data", "KEY_BYTES",
    ],
    "dpocache.data.values": ["PairValues", "stored"],
})
