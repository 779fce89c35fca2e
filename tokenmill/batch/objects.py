"""Stored rows as the OpenAI Files and Batch API objects the routes answer with."""

from __future__ import annotations

import json
import sqlite3
from decimal import Decimal
from typing import Any


def file_obj(r: sqlite3.Row) -> dict[str, Any]:
    return {"id": r["id"], "object": "file", "bytes": r["bytes"], "created_at": r["created_at"],
            "filename": r["filename"], "purpose": r["purpose"], "status": r["status"], "expires_at": None,
            "status_details": None}


def batch_obj(r: sqlite3.Row) -> dict[str, Any]:
    usage = {"input_tokens": r["input_tokens"], "input_tokens_details": {"cached_tokens": r["cached_tokens"]},
             "output_tokens": r["output_tokens"], "output_tokens_details": {"reasoning_tokens": r["reasoning_tokens"]},
             "total_tokens": r["input_tokens"] + r["output_tokens"]}
    obj = {"id": r["id"], "object": "batch", "endpoint": r["endpoint"],
           "errors": json.loads(r["errors"]) if r["errors"] else None,
           "input_file_id": r["input_file_id"], "completion_window": r["completion_window"], "status": r["status"],
           "output_file_id": r["output_file_id"], "error_file_id": r["error_file_id"]}
    for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at"):
        obj[k] = r[k]
    obj["request_counts"] = {"total": r["total"], "completed": r["completed"], "failed": r["failed"]}
    obj["metadata"] = json.loads(r["metadata"]) if r["metadata"] else None
    obj["usage"] = usage
    # an extension beside OpenAI's fields: what the batch cost so far, at batch rates
    obj["cost"] = {"total_usd": float(Decimal(r["cost_usd"])), "total_usd_exact": r["cost_usd"],
                   "card": r["cost_card"]}
    return obj
