"""Finding documents: BM25 over a corpus folder (the LangChain retriever lives in
``ragsnap.integrations.langchain``)."""
