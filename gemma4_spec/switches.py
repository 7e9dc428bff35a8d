"""The plugin's environment switches. Every path that has one is on unless its variable is "0"
(the README lists them); experimental paths are off unless their variable is "1"."""

from __future__ import annotations

import os


def turned_off(name: str) -> bool:
    """Whether the switch ``name`` (on by default) is set to "0"."""
    return os.environ.get(name, "1") == "0"


def turned_on(name: str) -> bool:
    """Whether the opt-in switch ``name`` (off by default) is set to "1"."""
    return os.environ.get(name, "0") == "1"
