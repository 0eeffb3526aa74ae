"""Adapters to the frameworks ragsnap users arrive from (LangChain)."""
