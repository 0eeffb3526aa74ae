"""Loading models: by name or file, converted weights, CPU weight layouts, bfloat16 products."""
