"""Preference data: rows read and checked, chat templates rendered, pairs tokenized, truncated
and keyed (``pairs``); a batch of pairs' values as one record (``values``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.data.pairs": [
        "DataError", "RawRow", "TokenizedPair", "SkippedRow", "PreferenceData", "example_key", "read_rows",
        "check_text", "template_inputs", "render_conversation", "truncate_pair", "tokenize_rows",
        "load_preference_data", "map_columns", "write_jsonl", "KEY_BYTES", "STANDARD_COLUMNS",
        "TEMPLATE_COLUMNS"
    ],
    "dpocache.data.values": ["PairValues", "stored"],
})
