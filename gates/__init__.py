"""The gate suite. Its pass bands (gates/bands.toml) travel with it and are handed to core.verdicts.judge."""

from pathlib import Path

BANDS_FILE = Path(__file__).resolve().parent / "bands.toml"
