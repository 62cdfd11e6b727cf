"""Reaching the Hugging Face Hub: corpora (`datasets`) and pretrained models (`huggingface_hub`) come from there.

The libraries retry an unreachable Hub for a minute or more, and wait without end on one that accepts a connection
but never answers (huggingface_hub passes timeout=None on its metadata requests); `require_hub` answers in seconds,
in one line, with the local alternative the caller names: it makes one HTTP request with connect and read timeouts.
HF_HUB_OFFLINE=1 skips the check (the libraries then use their caches).
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from urllib.parse import urlparse

from mtcli.errors import MtcliError, error_text

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
        # a connection is not an answer: one HEAD request, with the same limit on the reply
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        pass  # any HTTP status is an answer: the Hub is there
    except (OSError, ValueError) as e:  # refused, unknown host, timed out (socket.timeout is an OSError), bad URL
        reason = error_text(getattr(e, "reason", None) or e)
        if isinstance(getattr(e, "reason", e), TimeoutError) or isinstance(e, TimeoutError):
            reason = f"no answer within {PROBE_TIMEOUT_S:.0f} s"
        message = f"cannot reach the Hugging Face Hub at {host}:{port} to download {what} ({reason}). {instead}"
        raise MtcliError(message) from None
