"""The engine side of the kernel gate: the registry of an engine's own kernels, the seeded cases with the
oracle's exact math, and the runner that calls the kernels in the engine's environment. The verdict is the
gate's (gates/lib/kernels.py, gates/test_kernels.py).

Deliberately import-free: ``engine.kernels.runner`` runs inside the engine's environment (vllm + torch +
numpy + safetensors only) and must not pull in the harness.
"""
