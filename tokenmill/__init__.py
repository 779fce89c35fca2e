"""tokenmill: a fast, metered, protected OpenAI-compatible LLM serving system."""

__version__ = "0.1.0"
