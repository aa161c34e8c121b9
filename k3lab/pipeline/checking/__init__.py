"""Checking: a set against its manifest, its plan and (re-derived) its source (``verify``)."""
