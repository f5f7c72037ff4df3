"""DeepSeek-V4.1-Flash fp32 oracle."""
