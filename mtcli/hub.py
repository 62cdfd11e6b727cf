"""Reaching the Hugging Face Hub: corpora (`datasets`) and pretrained models (`huggingface_hub`) come from there.

The libraries retry an unreachable Hub for a minute or more; `require_hub` answers in seconds, in one line, with the
local alternative the caller names. HF_HUB_OFFLINE=1 skips the check (the libraries then use their caches).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from mtcli.errors import MtcliError

PROBE_TIMEOUT_S = 8.0


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def require_hub(what: str, instead: str) -> None:
    """Fail fast when the Hub is out of reach: `what` names the download, `instead` the local way to go on."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        message = f"cannot reach the Hugging Face Hub at {host}:{port} to download {what} ({reason}). {instead}"
        raise MtcliError(message) from None
