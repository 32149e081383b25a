"""DeepSeek-V4 building blocks, one concept per module."""
