"""Cache tiers: exact and prefix entries, per-document KV, and the in-memory maps in front of the store."""
