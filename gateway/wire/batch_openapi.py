"""The OpenAPI documents of the Files and Batch APIs' request bodies and ids (what schema fuzzing and
client generators read). Documented, not enforced here: the routes check bodies themselves and answer
an id of another format as an unknown one (404)."""

from __future__ import annotations

from typing import Any

FILE_ID_PATTERN = "^file-[0-9a-f]{24}$"
BATCH_ID_PATTERN = "^batch_[0-9a-f]{24}$"

FILES_CREATE_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}

BATCHES_CREATE_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["input_file_id", "endpoint", "completion_window"],
                    "additionalProperties": False,
                    "properties": {
                        "input_file_id": {"type": "string", "pattern": FILE_ID_PATTERN},
                        "endpoint": {
                            "type": "string",
                            "enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"],
                        },
                        "completion_window": {"type": "string", "enum": ["24h"]},
                        "metadata": {
                            "type": "object",
                            "maxProperties": 16,
                            "additionalProperties": {"type": "string", "maxLength": 512},
                        },
                    },
                }
            }
        },
    }
}
