"""ragsnap: RAG middleware with query-aware KV-cache compression for long-prompt QA."""

__version__ = "0.1.0"
