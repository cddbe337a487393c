"""The local API: OpenAI-compatible HTTP over the Unix socket, its request/response models and metrics."""
