"""ds41-gates: the quality gate between an LLM serving engine change and production."""

__version__ = "0.1.0"
