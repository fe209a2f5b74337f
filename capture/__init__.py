"""Buckets, padding and CUDA graph capture of the packed prefill step (metrale_graph.capture).

    from metrale_graph.capture import GraphRunner
    runner = GraphRunner(model, cache, batch_sizes=[1, 2, 4, 8, 16, 32],
                         token_counts=[256, 512, 1024, 2048, 4096, 8192])
    runner.warmup()                      # compile + capture every bucket
    logits = runner.prefill([...])       # same contract as model.prefill
"""

from .buckets import DEFAULT_BATCH_SIZES, DEFAULT_TOKEN_COUNTS, Bucket, choose, make_grid, split
from .runner import BucketEntry, BucketReport, GraphRunner

__all__ = ["GraphRunner", "BucketEntry", "BucketReport", "Bucket", "make_grid", "choose", "split",
           "DEFAULT_BATCH_SIZES", "DEFAULT_TOKEN_COUNTS"]
