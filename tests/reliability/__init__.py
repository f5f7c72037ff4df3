"""Helpers of the reliability and security suite (tests/test_reliability_*.py, docs/RELIABILITY.md)."""
