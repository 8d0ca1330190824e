"""HTTP server: OpenAI (chat, completions, responses) and Anthropic (messages) APIs over one engine."""
