"""The OpenAI-compatible HTTP API over the runtime (`engine serve`)."""
