"""The OpenAI-compatible routes: completions, chat, tokenization, responses."""
