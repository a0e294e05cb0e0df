"""Adapters that put dpocache's reference cache inside other trainers (optional dependencies)."""
