"""`hf://org/name` model sources: download a Hub snapshot into a local folder.

KServe's storage initializer does the same job in an init container; the operator renders one
that runs `gearshift fetch-model` (docs/operator.md), and `gearshift serve --model hf://...`
calls it directly. huggingface_hub does the transfer: `HF_TOKEN` authenticates, `HF_ENDPOINT`
points at a mirror, a pinned revision (a commit sha, a tag or a branch) selects the snapshot,
and files already in the folder at the same revision are not fetched again.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from gearshift.worker.errors import ModelLoadError

SCHEME = "hf://"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A revision becomes part of a folder name and a URL path: one safe path component, never "..".
# (Hub refs with "/", such as refs/pr/1, are pinned by their commit sha instead.)
REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
REVISION_RULE = (
    "a commit sha, tag or branch name of letters, digits, '.', '_' and '-' (no '/', no '..')"
)
MAX_REVISION_LENGTH = 255


def revision_error(revision: str) -> str | None:
    """Why `revision` is refused, or None when it is safe."""
    if (
        len(revision) > MAX_REVISION_LENGTH
        or ".." in revision
        or not re.fullmatch(REVISION_PATTERN, revision)
    ):
        return f"revision {revision[:80]!r}: must be {REVISION_RULE}"
    return None


# What a model folder needs: config, weights, tokenizer, chat template. Pickled checkpoints
# (*.bin, *.pt) are never fetched: Gearshift does not load them.
WEIGHT_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken")
TOKENIZER_PATTERNS = ("*.json", "*.jinja", "tokenizer.model", "*.tiktoken")


@dataclass(frozen=True)
class HubSource:
    """A Hub repository and the revision to pin (None: the default branch)."""

    repo: str
    revision: str | None = None

    @staticmethod
    def parse(uri: str, revision: str | None = None) -> HubSource:
        """`hf://org/name` or `hf://org/name@revision`; `revision` overrides the suffix."""
        if not uri.startswith(SCHEME):
            raise ModelLoadError(f"model {uri!r}: not an hf://org/name source")
        repo, _, suffix = uri.removeprefix(SCHEME).partition("@")
        if not _REPO.match(repo):
            raise ModelLoadError(f"model {uri!r}: expected hf://org/name[@revision]")
        pinned = revision or suffix or None
        error = revision_error(pinned) if pinned else None
        if error:
            raise ModelLoadError(f"model {uri!r}: {error}")
        return HubSource(repo, pinned)

    def folder_name(self) -> str:
        """A folder for this repo and revision, unique per pair, safe as one path component."""
        return f"{self.repo.replace('/', '--')}--{self.revision or 'main'}"


def fetch(
    source: HubSource, dest: Path, token: str | None = None, tokenizer_only: bool = False
) -> Path:
    """Download `source` into `dest` (created); returns `dest`. Clear errors for a missing
    repository, revision or file, and for a repository without loadable weights."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hf://{source.repo}" + (f" at revision {source.revision}" if source.revision else "")
    patterns = list(TOKENIZER_PATTERNS if tokenizer_only else WEIGHT_PATTERNS)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(
            source.repo,
            revision=source.revision,
            local_dir=dest,
            # Read per call, not when huggingface_hub was first imported.
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            token=token or os.environ.get("HF_TOKEN") or None,
            allow_patterns=patterns,
            max_workers=4,
        )
    except GatedRepoError as exc:
        raise ModelLoadError(f"{where}: the repository is gated; HF_TOKEN lacks access") from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(
            f"{where}: repository not found (or private, and HF_TOKEN is missing or has no access)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelLoadError(f"{where}: revision {source.revision!r} not found") from exc
    except RemoteEntryNotFoundError as exc:
        raise ModelLoadError(f"{where}: a file of the repository is missing: {exc}") from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ModelLoadError(f"{where}: download failed: {exc}") from exc
    check_folder(dest, where, tokenizer_only)
    return dest


def check_folder(folder: Path, where: str, tokenizer_only: bool = False) -> None:
    """A downloaded folder must hold what loading it needs; say what is missing."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    missing = []
    if not tokenizer_only:
        if "config.json" not in names:
            missing.append("config.json")
        if not any(n.endswith(".safetensors") for n in names):
            missing.append("*.safetensors weights (pickled *.bin checkpoints are not loaded)")
    if not names & {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"}:
        missing.append("a tokenizer (tokenizer.json)")
    if missing:
        raise ModelLoadError(f"{where}: the repository has no {', '.join(missing)}")


def fetch_to_cache(uri: str, cache_dir: Path, token: str | None = None) -> Path:
    """`hf://...` as a folder under `cache_dir` (one per repo and revision), fetched if needed."""
    source = HubSource.parse(uri)
    return fetch(source, cache_dir / source.folder_name(), token)
