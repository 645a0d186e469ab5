"""Use a trained model: the generation engine, the terminal chat and the OpenAI-compatible API server."""
