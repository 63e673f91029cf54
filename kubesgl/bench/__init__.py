"""`kubesgl bench`: load generators for a running kubesgl (or any OpenAI-compatible) server."""
