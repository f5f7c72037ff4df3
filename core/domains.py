"""The panel domains (gates.md §3): shared by panels (which items may claim) and bands (which tables exist)."""

DOMAINS: tuple[str, ...] = (
    "code",
    "math",
    "agentic",
    "knowledge",
    "multilingual",
    "chat",
    "writing",
    "structured",
)
