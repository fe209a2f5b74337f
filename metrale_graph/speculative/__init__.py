"""Speculative decoding's pieces (issue 39), apart from the engine: draft, then verify, then accept.

- acceptance.py: `target_probabilities`, `draw_uniforms`, `rejection_sample`: batched greedy acceptance and
  speculative rejection sampling.

The verify step (the main model over each stream's last token and drafts) and its state handling are the
engine's.
"""

from .acceptance import EMPTY, Accepted, draw_uniforms, rejection_sample, target_probabilities

__all__ = ["EMPTY", "Accepted", "draw_uniforms", "rejection_sample", "target_probabilities"]
