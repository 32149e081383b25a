"""The offline batch job: OpenAI Batch JSONL in, OpenAI Batch JSONL out, resumable."""
