"""The plugin's environment switches: every path that has one is on unless its variable is "0"
(the README lists them)."""

from __future__ import annotations

import os


def turned_off(name: str) -> bool:
    """Whether the switch ``name`` is set to "0"."""
    return os.environ.get(name, "1") == "0"
