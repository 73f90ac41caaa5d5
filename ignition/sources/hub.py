"""Resolve a Hugging Face hub id from the local cache only, then read it as an HF directory.

ignition never downloads: a model that is not cached is an ExportError telling the user to fetch it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ignition.errors import ExportError
from ignition.sources.base import Checkpoint
from ignition.sources.hf import looks_like_hub_id, open_hf_dir

__all__ = ["hub_cache_dir", "looks_like_hub_id", "open_hub_id"]


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, read from the environment now.

    NOTE: huggingface_hub.constants freezes these variables at import; reading them per call lets a test
    (or a CLI flag) point HF_HUB_CACHE elsewhere after import.
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def open_hub_id(repo_id: str, revision: str | None = None) -> Checkpoint:
    """The cached snapshot of `repo_id` (refs/main unless `revision`); identifier = the repo id."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if not looks_like_hub_id(repo_id):
        raise ExportError(f"'{repo_id}' is neither a directory nor a Hugging Face repo id (org/name)")
    cache = hub_cache_dir()
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except HFValidationError as e:
        raise ExportError(f"'{repo_id}' is not a valid Hugging Face repo id ({e})") from None
    except (LocalEntryNotFoundError, OSError):  # no refs/<revision> or no snapshots/<commit>
        raise ExportError(
            f"model '{repo_id}' is not in the local Hugging Face cache (HF_HUB_CACHE={cache}); "
            "ignition never downloads — download it first or pass a directory"
        ) from None
    ckpt = open_hf_dir(Path(snapshot))
    ckpt.identifier = repo_id
    return ckpt
