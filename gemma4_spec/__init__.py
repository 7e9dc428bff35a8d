"""gemma4-spec: Gemma 4 MTP speculative decoding for vLLM, delivered as a plugin."""

__version__ = "0.1.0"
