"""Root conftest. The ds41-gates pytest plugins (markers, options, fixtures) are `pytest11` entry points of the
installed project (pyproject.toml), not listed here."""
