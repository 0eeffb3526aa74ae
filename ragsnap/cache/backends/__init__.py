"""Stores of cache entries: the interface, the file and Redis stores, sealing and the URL factory."""
