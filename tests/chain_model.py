"""A tiny checkpoint whose greedy replies are known exactly, for serving tests of tool calls and reasoning:
its tokenizer's added tokens are the pieces of the replies, and its weights make the next token a fixed
function of the current one, switched by whether the context holds a `<tool_response>`.

    folder = chain_checkpoint(tmp_path / "ckpt")     # model + tokenizer with QWEN35_TEMPLATE

With the template's generation prompt (`<|im_start|>assistant\\n<think>\\n`) the model replies REASONING,
`</think>`, then the call CALL (get_weather, city Paris, days 3); once a tool's result is in the prompt it
replies AFTER_TOOL_REASONING and ANSWER instead; with enable_thinking false (the prompt ends in `</think>`)
it replies CALL alone.

How: every layer's output projection is zero, so the residual stream carries the current token's embedding
(an orthonormal direction b_t, plus a direction z that all tokens share) to the head, whose row for token j
is c * b_t for each t that j follows. The last layer (full attention) adds one thing: its queries read z
(the same for every token), its keys and values read only the marker token `<tool_response>`, so its output
is a direction u where the context holds the marker and zero elsewhere (every key but the marker's is zero:
the softmax then averages zero values). Tokens that follow t only with the marker have a head row of
0.5c * b_t + 0.7c * u: above the plain successor's c exactly when both t and u are there.
"""

from __future__ import annotations

import torch

# Qwen3.5 / Qwen3.6's chat format (tools in the system prompt, XML calls, tool results as a user turn of
# <tool_response> blocks, the generation prompt opening <think>), written for these tests
QWEN35_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "</function>\\n</tool_call>' }}"
    "{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if reasoning | trim %}{{- '<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- ('\\n\\n' if content | trim else '') if loop.first else '\\n' }}"
    "{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}"
    "{%- for name, value in (call.arguments or {}) | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}")

OPEN_THINK = "<think>\n"  # the generation prompt's last token
CLOSE_THINK = "</think>\n\n"  # the reply's end of reasoning, and the last token of a prompt without thinking
MARKER = "<tool_response>"
REASONING = "I will look up the weather in Paris."
AFTER_TOOL_REASONING = "The tool has answered."
CALL = ("<tool_call>\n<function=get_weather>\n", "<parameter=city>\nParis\n</parameter>\n",
        "<parameter=days>\n3\n</parameter>\n", "</function>\n</tool_call>")
ANSWER = "It is sunny in Paris, 22 degrees."
EOS = "<|im_end|>"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def _successors() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(token, next token) without the marker in the context, and those that replace them with it."""
    plain = [(OPEN_THINK, REASONING), (REASONING, CLOSE_THINK), (CLOSE_THINK, CALL[0]), *zip(CALL, CALL[1:]),
             (CALL[-1], EOS), (AFTER_TOOL_REASONING, CLOSE_THINK), (ANSWER, EOS)]
    with_marker = [(OPEN_THINK, AFTER_TOOL_REASONING), (CLOSE_THINK, ANSWER)]
    return plain, with_marker


def chain_checkpoint(folder, c: float = 10.0) -> str:
    """The checkpoint folder (model and tokenizer) described in the module's docstring."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from helpers import tiny_config
    from metrale_graph import HybridModel
    from tokenizer_fixture import build_tokenizer

    build_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    plain, with_marker = _successors()
    pieces = sorted({p for pair in plain + with_marker for p in pair if p != EOS} | {MARKER})
    # the pieces that hold a tag are special tokens, as Qwen3.5's tokenizer marks `<think>`, `<tool_call>`, ...: a
    # decode that skips special tokens drops them (the server keeps the text of those its parsers read)
    tok.add_tokens([AddedToken(p, normalized=False, special="<" in p) for p in pieces])
    tok.eos_token = EOS
    tok.chat_template = QWEN35_TEMPLATE
    tok.save_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = {p: tok.convert_tokens_to_ids(p) for p in [*pieces, EOS]}

    cfg = tiny_config(vocab_size=len(tok))
    model = HybridModel.from_preset(cfg, seed=0)
    weights = model.state_dict()
    D, V = cfg.hidden_size, cfg.vocab_size
    basis = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(0)))[0].T  # rows orthonormal
    z, u, directions = basis[0], basis[1], {p: basis[2 + i] for i, p in enumerate(pieces)}
    rest = basis[2 + len(pieces):]
    others = torch.randn(V, len(rest), generator=torch.Generator().manual_seed(1)) @ rest * 0.3
    embed = z + others
    for p, d in directions.items():
        embed[ids[p]] = z + d
    for name, w in weights.items():  # every output projection zero: the residual stream is the embedding
        if name.endswith(("out_proj.weight", "down_proj.weight", "o_proj.weight")) or "norm" in name:
            w.zero_()  # (norm weights are zero-centred: 0 is the identity scale)
    weights["embed_tokens.weight"].copy_(embed)

    layer = next(i for i, kind in enumerate(cfg.layer_types) if kind != "linear_attention")
    assert layer == cfg.num_hidden_layers - 1, "the marker's attention must be the last layer"
    attn, HD, HQ, HKV = f"layers.{layer}.self_attn", cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rotary = int(HD * cfg.partial_rotary_factor)  # channels past it are not rotated: scores independent of position
    q, k, v, o = (weights[f"{attn}.{n}_proj.weight"] for n in "qkvo")
    for w in (q, k, v):
        w.zero_()
    for h in range(HQ):
        q[h * 2 * HD + rotary] = z  # (the gate half stays zero: sigmoid(0) = 0.5)
        o[:, h * HD] = u * 0.1
    for g in range(HKV):
        k[g * HD + rotary] = directions[MARKER]
        v[g * HD] = directions[MARKER]
    weights[f"{attn}.q_norm.weight"][rotary] = 2.0  # scores 36 on the marker (3 * 3 * 16 / 4), 0 elsewhere
    weights[f"{attn}.k_norm.weight"][rotary] = 2.0

    head = torch.zeros(V, D)
    for t, j in plain:
        head[ids[j]] += c * directions[t]
    for t, j in with_marker:
        head[ids[j]] += 0.5 * c * directions[t] + 0.7 * c * u / _marker_strength(cfg)
    weights["lm_head.weight"].copy_(head)
    model.save_pretrained(str(folder))
    return str(folder)


def _marker_strength(cfg) -> float:
    """The u the attention layer adds where the context holds the marker (a plain token's embedding has norm
    sqrt 2, its z and b parts 1 each): v = the marker's b component after the input RMSNorm, halved by the gate,
    summed over the heads, times o_proj's 0.1."""
    return (cfg.hidden_size / 2) ** 0.5 * 0.5 * cfg.num_attention_heads * 0.1
