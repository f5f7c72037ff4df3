"""Root conftest: registers the ds41-gates pytest plugin (markers, options, fixtures)."""

pytest_plugins = ["ds41gates.pytest_plugin", "ds41gates.localize_plugin"]
