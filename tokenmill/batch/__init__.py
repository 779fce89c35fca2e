"""The Batch API's store and runner (OpenAI's /v1/files and /v1/batches shapes are
served by tokenmill/server/batch_api.py)."""
