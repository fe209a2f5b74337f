"""Tensor-parallel serving: rank 0's engine loop sends each step's plan, the other ranks replay it.

Under tensor parallelism every rank runs every step (the step's collectives meet across ranks), so
every rank must feed the same streams in the same order. Two ways to get there:

- Every rank calls `generate` / `stream` with the same arguments, one call at a time (tools.generate
  under torchrun): each rank's loop schedules the same requests the same way and samples the same
  tokens (the logits are gathered, the seeds shared), so no plan needs to travel.
- A server receives requests on rank 0 only, at times no other rank can know. There
  `Engine(..., broadcast_plans=True)`: rank 0's loop sends each step's plan before running it (the
  streams' slots and tokens, and the slots its scheduler reset since the last plan), and every other
  rank runs `engine.follow()`, which resets those slots and runs the same step. Followers schedule
  and sample nothing. Warmup is sent too (every rank compiles and captures the same buckets in the
  same order), and so is the end (`engine.shutdown()` on rank 0 ends `follow()` everywhere). While
  rank 0 has nothing to run it sends an idle message every IDLE_SYNC_S seconds, so a follower waiting
  in the broadcast never reaches the process group's timeout.

A message is one int64 tensor of a fixed size on the model's device, broadcast from the group's rank 0:

    [kind, n_streams, n_tokens, n_resets, n_decodes, n_sampling, slots[n_streams], lengths[n_streams],
     tokens[n_tokens], resets[n_resets], sampling[n_sampling], zeros...]

The first n_decodes streams are decodes, whose token each rank reads on the device (the engine loop's
last_tokens: their tokens in the message are placeholders); `sampling` are the rows rank 0 samples.
After each step rank 0 broadcasts the tokens it sampled (share_tokens, on the device: no rank waits for
them on the host) and every follower puts them in its own last_tokens.

A step that fails on rank 0 alone (not on the others) leaves the ranks out of step; tensor-parallel
serving has no recovery from that (a failure inside the step's collectives stops every rank anyway).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .batch import Stream
from .numbers import to_device

STEP, WARMUP, IDLE, SHUTDOWN = 1, 2, 3, 4
IDLE_SYNC_S = 5.0
_HEADER = 6


class PlanBroadcast:
    """The message channel of one engine over the model's tensor-parallel group."""

    def __init__(self, tp, device: torch.device, num_slots: int, token_budget: int):
        import torch.distributed as dist

        self.tp, self.device = tp, device
        # streams <= slots, tokens <= budget, resets <= slots, sampling rows <= streams
        self.size = _HEADER + 4 * num_slots + token_budget
        self._group = tp.group
        self._src = 0 if tp.group is None else dist.get_global_rank(tp.group, 0)

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def send(self, kind: int, streams: Sequence[Stream] = (), resets: Sequence[int] = (), decodes: int = 0,
             sampling: Sequence[int] = ()) -> None:
        """Rank 0: broadcast one message (blocks until every rank has entered the broadcast)."""
        import torch.distributed as dist

        tokens = [int(t) for s in streams for t in s.tokens]
        body = ([s.slot for s in streams] + [len(s.tokens) for s in streams] + tokens + list(resets)
                + list(sampling))
        header = [kind, len(streams), len(tokens), len(resets), decodes, len(sampling)]
        assert _HEADER + len(body) <= self.size, "a plan larger than the scheduler's limits"
        message = torch.zeros(self.size, dtype=torch.int64)
        message[:_HEADER + len(body)] = torch.tensor(header + body, dtype=torch.int64)
        dist.broadcast(to_device(message, self.device), self._src, group=self._group)

    def receive(self) -> tuple[int, list[Stream], list[int], int, list[int]]:
        """Another rank: the next message as (kind, streams, resets, decodes, sampling rows)."""
        import torch.distributed as dist

        message = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        dist.broadcast(message, self._src, group=self._group)
        values = message.tolist()
        kind, n, t, r, decodes, k = values[:_HEADER]
        at = _HEADER
        slots, at = values[at:at + n], at + n
        lengths, at = values[at:at + n], at + n
        tokens, at = values[at:at + t], at + t
        resets, at = values[at:at + r], at + r
        sampling = values[at:at + k]
        streams, start = [], 0
        for slot, length in zip(slots, lengths):
            streams.append(Stream(slot, tokens[start:start + length]))
            start += length
        return kind, streams, resets, decodes, sampling

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0: broadcast the tokens a step sampled (int64, on the device)."""
        import torch.distributed as dist

        dist.broadcast(tokens.contiguous(), self._src, group=self._group)

    def receive_tokens(self, n: int) -> torch.Tensor:
        """Another rank: the `n` tokens rank 0's step sampled (share_tokens), on the device."""
        import torch.distributed as dist

        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, self._src, group=self._group)
        return tokens


def follow(broadcast: PlanBroadcast, reset: Callable[[int], None],
           run_step: Callable[[list[Stream], int, list[int]], object], warmup: Callable[[], object]) -> None:
    """Replay rank 0's messages until it shuts down: reset the slots it reset, run its steps
    (run_step(streams, decodes, sampling rows)) and its warmup. A step that fails here fails on rank 0 too
    (the same streams, the same checks) and rank 0 fails that step's requests and goes on, so the follower
    goes on as well."""
    while True:
        kind, streams, resets, decodes, sampling = broadcast.receive()
        if kind == SHUTDOWN:
            return
        for slot in resets:
            reset(slot)
        if kind == STEP:
            try:
                run_step(streams, decodes, sampling)
            except Exception:  # the cache transaction reset the step's slots, as on rank 0
                pass
        elif kind == WARMUP:
            warmup()
