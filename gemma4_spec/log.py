"""Loggers whose records vLLM's logging configuration shows.

vLLM configures handlers for its own ``vllm`` logger only; a plugin's module logger outside that
tree is silent at INFO. Ours are children of it, named after our modules."""

from __future__ import annotations

import logging


def get_logger(module_name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.{module_name}")
