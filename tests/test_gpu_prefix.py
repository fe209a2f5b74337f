"""On a GPU: prefix caching under CUDA graphs, at the GraphRunner level. Two caches with prefix caching, one
driven by graph replays, one by eager `model.prefill`, go through the protocol the engine uses: prefills whose
interval checkpoints the GDN ops keep inside the (captured) step, save_prefix, restore_prefix (hits: full blocks
shared, a partial block copied, a checkpoint copied into the slot), reset, and decode-like steps. After each
operation both caches have made the same decisions (hits, blocks, checkpoint targets, prefix counters). After
each step: replay = eager for the logits, the batch's slots, its new KV rows and the checkpoints it wrote; the
logits also equal those of a plain cache (no prefix caching) fed every slot's whole history; and in both caches
everything else is bit-identical: slots outside the batch, every KV row but the batch's new tokens (shared
prefix blocks, the copied rows of a partial block, the null block), every checkpoint entry the step did not
write but the scratch entry. fp32 (tolerances of fp32 rounding; no bf16 near-tie in the comparisons)."""

import pytest
import torch

from helpers import unit_gain
from metrics import rel_err
from metrale_graph import HybridModel, PRESETS, Stream
from metrale_graph.capture import GraphRunner, choose
from metrale_graph.protocol import restore_prefix

pytestmark = pytest.mark.gpu

# 9B head shapes, fewer heads and a small hidden size (tests/test_gpu_capture.py's)
CFG = PRESETS["qwen3.5-9b"].replace(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                                    linear_num_value_heads=4)
DTYPE, TOL = torch.float32, 1e-4
TOL_PLAIN = 1e-3  # other chunk boundaries than the plain cache's (a keep-one-token-early bug: 4e-3)
SLOTS, BLOCKS, BS, MAX_CONTEXT = 6, 128, 64, 1024
CHECKPOINTS, INTERVAL = 12, 64  # few entries: the sequence below evicts some, one step evicts three
# two buckets, one compiled trace (both of several streams): every step below fits one of them, unsplit
BATCH_SIZES, TOKEN_COUNTS = [4], [4, 1024]


class Twins:
    """A graph-driven and an eager cache with prefix caching, given the same operations and compared after
    each; and a plain cache (no prefix caching) that is fed each slot's whole history, the logits' oracle."""

    def __init__(self, model: HybridModel, use_graphs: bool | None = None):
        opts = dict(num_slots=SLOTS, num_blocks=BLOCKS, block_size=BS, max_context=MAX_CONTEXT)
        self.model = model
        self.graph = model.new_cache(**opts, prefix_checkpoints=CHECKPOINTS, checkpoint_interval=INTERVAL)
        self.eager = model.new_cache(**opts, prefix_checkpoints=CHECKPOINTS, checkpoint_interval=INTERVAL)
        self.plain = model.new_cache(**opts)
        self.runner = GraphRunner(model, self.graph, batch_sizes=BATCH_SIZES, token_counts=TOKEN_COUNTS,
                                  use_graphs=use_graphs)
        self.history = [[] for _ in range(SLOTS)]  # the tokens each slot holds (in both prefix caches)
        self.fed_plain = [0] * SLOTS  # how many of them the plain cache's slot holds

    @property
    def caches(self):
        return self.graph, self.eager

    def same_decisions(self, what: str) -> None:
        g, e = self.caches
        assert g.context_lens == e.context_lens, f"{what}: context lengths"
        assert torch.equal(g.block_tables, e.block_tables), f"{what}: block tables"
        assert torch.equal(g.checkpoint_tokens, e.checkpoint_tokens), f"{what}: checkpoint targets"
        assert torch.equal(g.checkpoint_entries, e.checkpoint_entries), f"{what}: checkpoint entries"
        assert g.prefix_stats() == e.prefix_stats(), f"{what}: prefix counters"
        assert [len(h) for h in self.history] == g.context_lens

    # the operations --------------------------------------------------------------------------------
    def prefill(self, what: str, streams: list[tuple[int, list[int]]], checkpoints: int) -> None:
        """One step of `streams` (slot, new tokens) on both caches, which keeps `checkpoints` checkpoints."""
        g, e = self.caches
        slots, lengths = [s for s, _ in streams], [len(t) for _, t in streams]
        assert choose(self.runner.grid, len(streams), sum(lengths)) is not None, f"{what}: fits no bucket"
        context = list(g.context_lens)
        before = {id(c): _tensors(c) for c in self.caches}
        batch = [Stream(s, t) for s, t in streams]
        out_g = self.runner.prefill(batch)
        out_e = self.model.prefill(e, batch)
        # the oracle: each slot's whole history prefilled into a cache that never restored anything
        want = self.model.prefill(self.plain, [Stream(s, self.history[s][self.fed_plain[s]:] + list(t))
                                               for s, t in streams])
        for s, t in streams:
            self.history[s] += list(t)
            self.fed_plain[s] = len(self.history[s])
        self.same_decisions(what)
        assert rel_err(out_g, out_e) <= TOL, f"{what}: logits, replay vs eager {rel_err(out_g, out_e):.2e}"
        assert rel_err(out_e, want) <= TOL_PLAIN, f"{what}: logits vs the plain cache {rel_err(out_e, want):.2e}"

        written = g.checkpoint_entries[g.checkpoint_tokens >= 0].tolist()  # this step's (one piece: its plan)
        assert len(written) == checkpoints and len(set(written)) == len(written), f"{what}: checkpoints {written}"
        assert g.scratch_checkpoint not in written
        state_rows = torch.zeros(SLOTS + 1, dtype=torch.bool, device=g.device)
        state_rows[slots] = True
        kv_rows = torch.zeros(BLOCKS + 1, BS, dtype=torch.bool)  # the rows of the batch's new tokens
        tables = g.block_tables.cpu()
        for s, n in zip(slots, lengths):
            p = torch.arange(context[s], context[s] + n)
            kv_rows[tables[s, p // BS].long(), p % BS] = True
        kv_rows = kv_rows.to(g.device)
        entry_rows = torch.zeros(CHECKPOINTS + 1, dtype=torch.bool, device=g.device)
        entry_rows[written] = True
        allowed = entry_rows.clone()
        allowed[g.scratch_checkpoint] = True  # padding's (and no target's) destination

        for c in self.caches:
            _assert_untouched(f"{what} ({'replay' if c is g else 'eager'})", c, before[id(c)], state_rows, kv_rows,
                              allowed, written)
        for a, b in zip(g.conv_states + g.gdn_states, e.conv_states + e.gdn_states):
            assert rel_err(a[state_rows], b[state_rows]) <= TOL, f"{what}: the batch's slot states"
        for a, b in zip(g.k_caches + g.v_caches, e.k_caches + e.v_caches):
            assert rel_err(a[kv_rows], b[kv_rows]) <= TOL, f"{what}: the batch's new KV rows"
        if written:
            for a, b in zip(g.checkpoint_conv_states + g.checkpoint_gdn_states,
                            e.checkpoint_conv_states + e.checkpoint_gdn_states):
                assert rel_err(a[entry_rows], b[entry_rows]) <= TOL, f"{what}: the checkpoints written"

    def restore(self, slot: int, tokens: list[int], expect: int) -> None:
        """restore_prefix into empty `slot` on both caches: `expect` tokens restored."""
        g, e = self.caches
        got = [restore_prefix(self.model, c, slot, tokens) for c in self.caches]
        assert got == [expect, expect], f"restore into slot {slot}: {got} tokens, expected {expect}"
        self.history[slot], self.fed_plain[slot] = list(tokens[:expect]), 0
        self.plain.reset(slot)
        self.same_decisions(f"restore into slot {slot}")
        for a, b in zip(g.conv_states + g.gdn_states, e.conv_states + e.gdn_states):
            assert rel_err(a[slot], b[slot]) <= TOL, f"restore into slot {slot}: the restored states"

    def keep(self, slot: int) -> None:
        """save_prefix of `slot` on both caches (a new checkpoint entry each)."""
        assert [c.save_prefix(slot) for c in self.caches] == [True, True], f"keep slot {slot}"
        self.same_decisions(f"keep slot {slot}")

    def reset(self, slot: int) -> None:
        for c in (*self.caches, self.plain):
            c.reset(slot)
        self.history[slot], self.fed_plain[slot] = [], 0
        self.same_decisions(f"reset slot {slot}")


def _assert_untouched(what: str, cache, before: dict, state_rows, kv_rows, allowed, written: list[int]) -> None:
    """Since `before` (_tensors), only the slot states of `state_rows`, the KV rows of `kv_rows` and the
    checkpoint entries of `allowed` changed; every entry of `written` did (the step wrote it)."""
    for got, prev in zip(cache.conv_states + cache.gdn_states, before["states"]):
        assert torch.equal(got[~state_rows], prev[~state_rows]), f"{what}: a slot outside the batch changed"
    for got, prev in zip(cache.k_caches + cache.v_caches, before["kv"]):
        assert torch.equal(got[~kv_rows], prev[~kv_rows]), (
            f"{what}: a KV row outside the batch's new tokens changed (another slot's, a shared prefix block's, "
            "the null block's)")
    for got, prev in zip(cache.checkpoint_conv_states + cache.checkpoint_gdn_states, before["checkpoints"]):
        assert torch.equal(got[~allowed], prev[~allowed]), f"{what}: a checkpoint entry the step did not write changed"
    for got, prev in zip(cache.checkpoint_gdn_states, before["checkpoints"][len(cache.checkpoint_conv_states):]):
        for e in written:
            assert not torch.equal(got[e], prev[e]), f"{what}: checkpoint entry {e} was not written"


def _tensors(cache) -> dict:
    return {"states": [t.clone() for t in cache.conv_states + cache.gdn_states],
            "kv": [t.clone() for t in cache.k_caches + cache.v_caches],
            "checkpoints": [t.clone() for t in cache.checkpoint_conv_states + cache.checkpoint_gdn_states]}


def run_sequence(twins: Twins, seed: int = 0) -> None:
    """Requests sharing prefixes, the engine's way: prompts prefilled (checkpoints every 64 tokens kept inside
    the step), kept, ended; later prompts restored from them and prefilled from there; decodes between."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prefix, x0, q, x3 = draw(300), draw(40), draw(192), draw(10)
    # 340 tokens: 64..320 kept inside the step; q: 64, 128 and 192, its last token; prefix + x3 reaches 64..256
    # too, the same prefixes as slot 0's: planned once
    twins.prefill("four prompts", [(0, prefix + x0), (1, q), (2, draw(30)), (3, prefix + x3)], checkpoints=8)
    twins.keep(3)  # 310 tokens: 4 full blocks and a partial one of 54 rows, labelled
    q2 = draw(200)
    twins.prefill("continued prompts", [(1, q2), (2, draw(100))], checkpoints=3)  # 256, 320, 384 from 192
    twins.prefill("decode", [(s, draw(1)) for s in range(4)], checkpoints=0)
    twins.keep(0)  # the request ends (341 tokens kept: an entry evicted), and so does slot 3's
    twins.reset(0)
    twins.reset(3)
    assert twins.graph.prefix_stats()["evicted_checkpoints"] == 1

    y, z, w = draw(50), draw(150), draw(28)
    twins.restore(4, prefix + x3 + y, 310)  # slot 3's kept prefix: 4 shared blocks, the partial one copied
    twins.restore(5, prefix + x0[:20] + z, 320)  # a checkpoint written inside the first step, 5 shared blocks
    twins.restore(0, prefix + x3 + [y[0]], 310)  # a one-token suffix
    twins.restore(3, q + q2[:100] + w, 256)  # a checkpoint of the second step (kept with prior context)
    # slot 5's suffix keeps 384 and 448, slot 3's 320 at its last token; the pool is full: three evicted
    twins.prefill("restored prompts", [(4, y), (5, z), (0, [y[0]]), (3, q2[64:100] + w)], checkpoints=3)
    assert twins.graph.prefix_stats()["evicted_checkpoints"] == 4
    twins.prefill("decode after hits", [(s, draw(1)) for s in (4, 5, 0, 3)], checkpoints=0)

    v, v3 = draw(10), draw(30)
    twins.reset(5)
    twins.restore(5, prefix + x0[:20] + z[:130] + v, 448)  # a checkpoint the restored prompts' step kept
    twins.reset(3)
    twins.restore(3, q + q2[:100] + w + v3, 320)  # the one kept at that step's last token of slot 3
    twins.prefill("second hits", [(5, z[128:130] + v), (3, v3), (1, draw(5)), (2, draw(64))], checkpoints=0)
    stats = twins.graph.prefix_stats()
    assert stats["hits"] == 6 and stats["hit_tokens"] == 310 + 320 + 310 + 256 + 448 + 320, stats


@pytest.fixture(scope="module")
def model():
    return unit_gain(HybridModel.from_preset(CFG, dtype=DTYPE, device="cuda", seed=21), 21)


def test_prefix_hits_replay_like_eager(model):
    twins = Twins(model)
    assert twins.runner.use_graphs
    twins.runner.warmup(progress=False)
    run_sequence(twins)
    assert all(entry.graphs is not None for entry in twins.runner.entries.values())
