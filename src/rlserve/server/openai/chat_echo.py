"""Chat `echo` as vLLM 0.32 reads it: the reply starts with the last message's content when that message has
the reply's role (assistant, or with add_generation_prompt false the last message's own role), and prompt
logprobs come back (top_logprobs of them) unless the request set prompt_logprobs itself."""

from __future__ import annotations

from rlserve.server.protocol import ChatCompletionRequest


def echoed(body: ChatCompletionRequest) -> str:
    if not body.echo or not body.messages:
        return ""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content)


def echo_prompt_logprobs(body: ChatCompletionRequest, top_logprobs: int | None) -> int | None:
    if body.prompt_logprobs is not None or not body.echo or body.stream:
        return body.prompt_logprobs
    return top_logprobs or 0
