"""A cache-aware router in front of several radixrelay servers (replicas): an OpenAI-compatible front
that sends each request to the replica most likely to hold its prompt's prefix in KV cache, weighed
against load (``radixrelay router``; docs/router.md)."""
