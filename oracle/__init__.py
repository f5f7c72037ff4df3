"""Oracles: an `EncodedPanel` in, an oracle `Record` out (oracle.seam.Oracle)."""

from oracle.seam import Oracle

__all__ = ["Oracle"]
