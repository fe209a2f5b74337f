"""Tensor-parallel serving: rank 0's engine loop sends each step's plan, the other ranks replay it.

Under tensor parallelism every rank runs every step (the step's collectives meet across ranks), so
every rank must feed the same streams in the same order. Two ways to get there:

- Every rank calls `generate` / `stream` with the same arguments, one call at a time (tools.generate
  under torchrun): each rank's loop schedules the same requests the same way and samples the same
  tokens (the logits are gathered, the seeds shared), so no plan needs to travel.
- A server receives requests on rank 0 only, at times no other rank can know. There
  `Engine(..., broadcast_plans=True)`: rank 0's loop sends each step's plan before running it (the
  streams' slots and tokens, and the journal of what it did to the cache's bookkeeping since the last
  plan: slots reset, and with prefix caching prefixes kept, looked up and restored, steps committed;
  plan_journal.py), and every other rank runs `engine.follow()`, which replays the journal on its cache
  and runs the same step. Followers schedule and sample nothing. Warmup is sent too (every rank compiles
  and captures the same buckets in the same order), and so is the end (`engine.shutdown()` on rank 0
  ends `follow()` everywhere). While rank 0 has nothing to run it sends an idle message every
  IDLE_SYNC_S seconds, so a follower waiting in the broadcast never reaches the process group's timeout.

A message is int64s broadcast from the group's rank 0 on the model's device, in one tensor of a fixed size
(`PlanBroadcast.size`, room for a decode step of every slot and a full token budget) and, when a plan is longer
(a journal holding restored prompts), a second tensor of the rest:

    [kind, n_streams, n_tokens, n_journal, n_decodes, n_sampling, free_blocks, free_entries, n_extra, length,
     slots[n_streams], lengths[n_streams], tokens[n_tokens], journal[n_journal], sampling[n_sampling],
     extra[n_extra], zeros...]

The first n_decodes streams of a STEP are decodes, whose token each rank reads on the device (the engine loop's
last_tokens: their tokens in the message are placeholders); `sampling` are the rows rank 0 samples; `extra` what
a kind needs besides (STEP: its prompt-logprob chunks, prompt_logprobs.scored_chunks); (free_blocks,
free_entries) is rank 0's cache as the message is sent (plan_journal.cache_state), which a follower checks after
its replay; `length` is the whole message's. After each step rank 0 broadcasts the tokens it sampled
(share_tokens, on the device: no rank waits for them on the host) and every follower puts them in its own
last_tokens.

Speculative decoding (speculative/following.py) adds two kinds: SPECULATE, a verify step (every stream's tokens
in the message, the drafts included; `extra` how rank 0 accepts), after which rank 0 shares each row's accept
count and last token, and DRAFT, the MTP head's catch-up and drafts after it (`extra` their rows), which every
rank runs (the head is sharded too). The end (SHUTDOWN) carries the journal as well, so that a follower gives
back what rank 0 did.

A step that fails on rank 0 alone (not on the others) leaves the ranks out of step; tensor-parallel
serving has no recovery from that (a failure inside the step's collectives stops every rank anyway).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from .batch import Stream
from .numbers import to_device

STEP, WARMUP, IDLE, SHUTDOWN, SPECULATE, DRAFT = 1, 2, 3, 4, 5, 6
IDLE_SYNC_S = 5.0
_HEADER = 10


class Plan(NamedTuple):
    """A message as a follower receives it (the module docstring)."""
    kind: int
    streams: list[Stream]
    journal: list[int]  # plan_journal.py's operations
    decodes: int
    sampling: list[int]
    state: tuple[int, int]  # rank 0's plan_journal.cache_state
    extra: list[int]  # what the kind needs besides (the module docstring)


class PlanBroadcast:
    """The message channel of one engine over the model's tensor-parallel group."""

    def __init__(self, tp, device: torch.device, num_slots: int, token_budget: int):
        import torch.distributed as dist

        self.tp, self.device = tp, device
        # a decode step of every slot: slots, lengths, tokens, sampling rows and its commit's ids (plan_journal.py),
        # with room for a few resets; a prompt chunk's tokens <= budget. A longer plan takes a second broadcast.
        self.size = _HEADER + 6 * num_slots + token_budget + 8
        self._group = tp.group
        self._src = 0 if tp.group is None else dist.get_global_rank(tp.group, 0)

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def send(self, kind: int, streams: Sequence[Stream] = (), journal: Sequence[int] = (), decodes: int = 0,
             sampling: Sequence[int] = (), state: tuple[int, int] = (0, 0), extra: Sequence[int] = ()) -> None:
        """Rank 0: broadcast one message (blocks until every rank has entered the broadcast)."""
        import torch.distributed as dist

        tokens = [int(t) for s in streams for t in s.tokens]
        body = ([s.slot for s in streams] + [len(s.tokens) for s in streams] + tokens + list(journal)
                + list(sampling) + list(extra))
        length = _HEADER + len(body)
        header = [kind, len(streams), len(tokens), len(journal), decodes, len(sampling), *state, len(extra), length]
        message = torch.zeros(max(self.size, length), dtype=torch.int64)
        message[:length] = torch.tensor(header + body, dtype=torch.int64)
        message = to_device(message, self.device)
        dist.broadcast(message[:self.size], self._src, group=self._group)
        if length > self.size:  # (a journal holding restored prompts, mostly)
            dist.broadcast(message[self.size:], self._src, group=self._group)

    def receive(self) -> Plan:
        """Another rank: the next message."""
        import torch.distributed as dist

        message = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        dist.broadcast(message, self._src, group=self._group)
        values = message.tolist()
        kind, n, t, j, decodes, k, free_blocks, free_entries, e, length = values[:_HEADER]
        if length > self.size:
            rest = torch.zeros(length - self.size, dtype=torch.int64, device=self.device)
            dist.broadcast(rest, self._src, group=self._group)
            values += rest.tolist()
        at = _HEADER
        slots, at = values[at:at + n], at + n
        lengths, at = values[at:at + n], at + n
        tokens, at = values[at:at + t], at + t
        journal, at = values[at:at + j], at + j
        sampling, at = values[at:at + k], at + k
        extra = values[at:at + e]
        streams, start = [], 0
        for slot, length in zip(slots, lengths):
            streams.append(Stream(slot, tokens[start:start + length]))
            start += length
        return Plan(kind, streams, journal, decodes, sampling, (free_blocks, free_entries), extra)

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0: broadcast the tokens a step sampled (int64, on the device; a speculative step's accept counts and
        last tokens too)."""
        import torch.distributed as dist

        dist.broadcast(tokens.contiguous(), self._src, group=self._group)

    def receive_tokens(self, n: int) -> torch.Tensor:
        """Another rank: the `n` tokens rank 0's step sampled (share_tokens), on the device."""
        import torch.distributed as dist

        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, self._src, group=self._group)
        return tokens


def follow(broadcast: PlanBroadcast, replay: Callable[[list[int], tuple[int, int]], None],
           handlers: dict[int, Callable[[Plan], object]]) -> None:
    """Replay rank 0's messages until it shuts down: its journal of the cache's bookkeeping (replay(journal,
    state): plan_journal.JournalReplay.replay), then the message's handler (STEP: the loop's follow_step; WARMUP;
    SPECULATE and DRAFT with speculative decoding). A step that fails here fails on rank 0 too (the same streams,
    the same checks) and rank 0 fails that step's requests and goes on, so the follower goes on as well; a
    warmup that fails ends follow() (rank 0's raises too)."""
    while True:
        plan = broadcast.receive()
        replay(plan.journal, plan.state)
        if plan.kind == SHUTDOWN:
            return
        if plan.kind == IDLE:
            continue
        handler = handlers.get(plan.kind)
        if handler is None:
            what = "a speculative step" if plan.kind in (SPECULATE, DRAFT) else f"a message of kind {plan.kind}"
            raise RuntimeError(f"rank 0 sent {what} this rank's Engine does not run: give every rank the same Engine "
                               "arguments (speculative=...) and the same metrale-graph")
        if plan.kind == WARMUP:
            handler(plan)
            continue
        try:
            handler(plan)
        except Exception:  # the cache transaction reset the step's slots, as on rank 0
            pass
