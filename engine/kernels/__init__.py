"""In-process kernel gates: an engine's own kernels beside the oracle's exact math.

Deliberately import-free: ``engine.kernels.runner`` runs inside the engine's environment (vllm + torch +
numpy + safetensors only) and must not pull in the harness.
"""
