"""Checkpoint I/O: safetensors reading, name translation (original ⇄ HF ⇄ dsjax), loading."""
