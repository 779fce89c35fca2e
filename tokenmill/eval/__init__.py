"""Task evals: run a suite of tasks with automatic checkers against any OpenAI-compatible server."""
