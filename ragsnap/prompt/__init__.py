"""The prompt: documents, assembly, roles and structure, the question's focus, chat messages."""
