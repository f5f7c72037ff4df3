"""Nightly runs and per-flag A/B: the flag registry and its TOMLs, the A/B statistics, the nightly matrix
runner, its SQLite history and trend plots, and the `ds41gate nightly` / `ds41gate flags` commands.

Imports core, engine and reports; nothing in core, panels, oracle, engine or reports imports this package.
Configs: nightly/configs/*.toml. Registries: nightly/flags.toml (the target's flags),
nightly/flags-vllm-cpu.toml (real vLLM CPU knobs). docs/NIGHTLY.md.
"""
