"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as vLLM 0.32 serves it,
run on the chat path."""
