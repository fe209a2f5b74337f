"""Speculative decoding (issue 39): draft, then verify, then accept; the pieces, then the engine's step.

- options.py: the user's `speculative=` option checked against the model (`check_speculative`; `parse_speculative`
  without it), and vLLM's --speculative-config as that option (`from_vllm`).
- proposers.py: `ngram_propose`, prompt lookup over a stream's tokens (no weights).
- mtp.py: the checkpoint's MTP head as a drafter: `mtp_hidden_states` (its step), `draft_mtp` (k drafts for a
  stream, eager).
- acceptance.py: `draw_uniforms`, `draw_positions`, `accept_drawn`: batched acceptance of one-hot drafts (the
  engine's: each position's token drawn as a plain step draws it, drafts kept while they match), and
  `target_probabilities` + `rejection_sample`, speculative rejection sampling of drafts drawn from any q.

- verify.py: the engine's speculative step (Engine(speculative=...)): drafts verified in one step of the main
  model, the accepted run's GDN / conv state made the slot's (in-step checkpoints), stops applied in order.
- drafting.py: the MTP head's catch-up and drafts batched over a step's requests.
- stops.py: where a request stops inside the drafts a verify step kept, before the slot commits them.
- tail.py: acceptance and the MTP head's drafts as functions of static buffers, which capture/speculative.py
  compiles and (on CUDA) captures per verify bucket.

docs/speculative.md has the state handling and what the first version does not do.
"""

from .acceptance import (EMPTY, Accepted, Uniforms, accept_drawn, draw_positions, draw_uniforms, rejection_sample,
                         target_probabilities)
from .mtp import Draft, draft_mtp, mtp_hidden_states
from .options import DEFAULT_MAX_STREAMS, METHODS, Speculative, check_speculative, from_vllm, parse_speculative
from .proposers import ngram_propose

__all__ = ["Accepted", "DEFAULT_MAX_STREAMS", "Draft", "EMPTY", "METHODS", "Speculative", "Uniforms", "accept_drawn",
           "check_speculative", "draft_mtp", "draw_positions", "draw_uniforms", "from_vllm", "mtp_hidden_states",
           "ngram_propose", "parse_speculative", "rejection_sample", "target_probabilities"]
