"""Thin routers: parse, check, queue, stream."""
