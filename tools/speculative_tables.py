"""The speculative workloads' record (tools/bench_speculative.py's "speculative" part) as the tables the tool
prints: the verify steps, the engine loop's host time by function (--host-profile), the MTP head's drafting, the
echo workload and the projection at published acceptance."""

from __future__ import annotations

from metrale_graph.tools.engine_windows import FORCED
from metrale_graph.tools.report import format_table


def render(spec: dict) -> str:
    """The speculative part of a record as the tables the tool prints."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    def opt(x):
        return "-" if x is None else x

    setup, parts = spec["setup"], []
    if spec["verify"]:
        parts.append(f"speculative decoding's steps (steady state, {setup['context']} prompt tokens per stream, "
                     f"{setup['steps']} steps a window); ngram rows: {FORCED}; k 0: no drafts\n" + format_table(
                         ["streams", "engine", "k", "step ms", "device ms", "GPU busy", "device work/step", "tokens/step",
                          "ms/token", "proposed", "accepted", "x plain"],
                         [[r["streams"], r["engine"], r["k"], r["step_ms"], opt(r["device_ms"]), pct(r["gpu_busy"]),
                           opt(r.get("device_activities")), r["tokens_per_step"], r["ms_per_token"], r["proposed"],
                           r["accepted"], r["vs_plain"]]
                          for r in spec["verify"]]))
    drafting = [r for r in spec["verify"] if "draft_calls" in r]
    if drafting:
        parts.append("the MTP head's drafting inside the MTP engine's steps (MtpDrafter.draft: the catch-up over the "
                     "kept positions, then a head step per further draft; device synchronized around each)\n"
                     + format_table(["streams", "k", "ms/step", "ms/draft position", "catch-up ms", "head step ms",
                                     "drafts"],
                                    [[r["streams"], r["k"], r["draft_ms_per_step"], opt(r["draft_ms_per_position"]),
                                      opt(r["draft_catchup_ms"]), opt(r["draft_head_step_ms"]), r["draft_tokens"]]
                                     for r in drafting]))
    hosted = [r for r in spec["verify"] if r.get("host_top")]
    if hosted:
        parts.append("the engine loop's host time a step, by function (sampled: self ms, the largest; --host-profile)\n"
                     + format_table(["streams", "engine", "k", "step ms", "functions (self ms a step)"],
                                    [[r["streams"], r["engine"], r["k"], r["step_ms"], "; ".join(
                                        f"{f.split(' (')[0]} {own}" for f, _, own in
                                        sorted(r["host_top"], key=lambda x: -x[2])[:6] if own > 0)] for r in hosted]))
    if spec["echo"]:
        parts.append("echo (prompt P + its greedy continuation C + P; tokens/s of the whole generate call)\n"
                     + format_table(["streams", "prompt", "new", "plain tok/s", "ngram tok/s", "speed-up",
                                     "acceptance", "plain steps", "ngram steps", "same output", "echoed C"],
                                    [[r["streams"], r["prompt_tokens"], r["new_tokens"], r["plain_tok_s"],
                                      r["ngram_tok_s"], f"{r['speedup']:.2f}x", pct(r["acceptance"]), r["plain_steps"],
                                      r["ngram_steps"], pct(r["same_output"]), pct(r["echoed"])] for r in spec["echo"]]))
    if spec["projection"]:
        parts.append(f"PROJECTION, not a measurement: tokens/s at {setup['published']['source']}, from the measured "
                     "step\n" + format_table(
                         ["streams", "k", "tokens/step", "step ms", "from", "projected tok/s", "plain tok/s",
                          "speed-up"],
                         [[r["streams"], r["k"], r["acceptance_length"], r["step_ms"], r["from"], r["projected_tok_s"],
                           r["plain_tok_s"], f"{r['speedup']:.2f}x"] for r in spec["projection"]]))
    return "\n\n".join(parts)
