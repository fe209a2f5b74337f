"""Buckets, padding and CUDA graph capture of the packed prefill step (metrale_graph.capture)."""
