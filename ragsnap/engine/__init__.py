"""The engine: its configuration, the engine itself, decoding and the batching scheduler."""
