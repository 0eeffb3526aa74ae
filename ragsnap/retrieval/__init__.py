"""Getting documents into the prompt: prompt assembly and retrievers."""
