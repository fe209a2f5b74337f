"""POST /v1/chat/completions: messages through the tokenizer's chat template, the assistant's reply
whole or streamed.

The prompt is `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` as token ids
(vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs change its arguments). A
stream sends, per choice, a first delta with the role (`{"role": "assistant", "content": ""}`),
then content deltas as the text comes, the last one with the finish reason ("stop": a stop token
or string; "length": max_tokens or the context), then the usage chunk with
stream_options.include_usage, then `data: [DONE]`.
"""

from __future__ import annotations

from typing import AsyncIterator

from .errors import stream_event
from .generation import Generations
from .protocol import (DONE, AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletionRequest,
                       ChatResponse, DeltaMessage, StreamChunks, event, now, request_id)
from .state import ServerState


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw_request):
    """A ChatResponse, or the event stream's body when body.stream."""
    state.check(body)
    prompt = await state.off_loop(state.chat_prompt_ids, [m.template_dict() for m in body.messages],
                                  body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
    state.check_room([prompt], body)
    group = Generations.submit(state, [prompt], state.sampling(body, body.max_new_tokens), body.n, param="messages")
    rid = request_id("chatcmpl")
    if body.stream:
        return _events(state, body, group, rid)
    results = await group.whole(raw_request)
    ids = body.return_token_ids
    choices = [ChatChoice(index=i, message=AssistantMessage(content=r.text or ""), finish_reason=r.finish_reason,
                          token_ids=list(r.token_ids) if ids else None, prompt_token_ids=prompt if ids else None)
               for i, r in enumerate(results)]
    return ChatResponse(id=rid, model=state.model_name, choices=choices, usage=group.usage())


async def _events(state: ServerState, body: ChatCompletionRequest, group: Generations, rid: str) -> AsyncIterator[str]:
    created, model, ids = now(), state.model_name, body.return_token_ids

    def chunk(choices, usage=None) -> str:
        return event(ChatChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

    chunks = StreamChunks("chat.completion.chunk", rid, created, model)
    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(len(group))])
        async for choice, out in group.stream():
            if not (out.text or out.finish_reason or (ids and out.token_ids)):
                continue
            yield chunks.chat(choice, out.text or None, out.finish_reason, list(out.token_ids) if ids else None)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], group.usage())
    except Exception as e:  # the request failed after the stream began (a step's error, shutdown)
        yield stream_event(e)
    finally:
        group.close()
    yield DONE
