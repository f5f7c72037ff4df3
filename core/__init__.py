"""The ground floor: the record format, the metric definitions, pass bands, and the small IO helpers
every other package shares. Nothing here imports from panels, oracle, engine, gates, reports or the
wiring above them (tests/test_floors.py holds that rule)."""
