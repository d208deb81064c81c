"""/upload_adapter's body: capped while it arrives, written as a PEFT directory under a fresh temp dir.
Client file names are never used as paths, and only safetensors and JSON are parsed (no pickle)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import Request

from rlserve.model.mlx_adapter import convert_mlx_adapter
from rlserve.model.shape import ModelShape
from rlserve.server.errors import APIError, bad_request


def write_uploaded_adapter(weights: bytes, config: bytes, target: Path, shape: ModelShape) -> None:
    """MLX layout (`lora_parameters`) is converted; PEFT layout (`r`) is written as is."""
    try:
        cfg = json.loads(config)
        if isinstance(cfg, dict) and "lora_parameters" not in cfg and "r" in cfg:  # PEFT layout: as is
            (target / "adapter_config.json").write_bytes(config)
            (target / "adapter_model.safetensors").write_bytes(weights)
        else:
            convert_mlx_adapter(weights, config, target, shape)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise bad_request(f"invalid adapter upload: {exc}", "adapter_weights") from None
    except Exception as exc:  # safetensors' own errors for a malformed file
        raise bad_request(
            f"invalid adapter upload: adapter_weights is not a safetensors file ({exc})", "adapter_weights"
        ) from None


def capped(request: Request, cap: int) -> Request:
    """The same request, refusing (413) once more than `cap` body bytes have arrived."""
    received = 0

    async def receive():
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > cap:
            raise APIError(413, f"upload exceeds server.max_upload_bytes ({cap} bytes)")
        return message

    return Request(request.scope, receive)
