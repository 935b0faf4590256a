"""Summarizing documents: prompts, chunking, the stream / map-reduce pipeline, one
summarize job, and batches of them."""
