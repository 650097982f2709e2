"""One commit for every pod of an hf:// deployment: a branch or tag (default `main`) is resolved
once, kept in `status.model`, and every init container downloads that commit.

Without a pin, each pod's init container resolves `main` itself when it starts, so the ranks of
one group (or a group restarted later) can load different commits. The pin changes only when the
spec's source or revision changes; a commit sha needs no resolving at all.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError

COMMIT = re.compile(r"[0-9a-f]{40}")
DEFAULT_REVISION = "main"
RESOLVE_TIMEOUT_S = 10.0

# (repo id, branch or tag) → its commit sha. The operator's is hub_resolver; tests pass fakes.
Resolver = Callable[[str, str], str]


def hub_resolver(repo: str, revision: str) -> str:
    """Ask the Hub (HF_ENDPOINT, HF_TOKEN of the operator's own pod) which commit `revision`
    of `repo` is. Private repositories need the token, or a commit sha in the spec."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    info = api.model_info(
        repo, revision=revision, token=os.environ.get("HF_TOKEN") or None, timeout=RESOLVE_TIMEOUT_S
    )
    return str(info.sha or "")


def pin(
    spec: DeploymentSpec, previous: dict[str, Any] | None, resolver: Resolver
) -> tuple[DeploymentSpec, dict[str, Any] | None]:
    """`spec` with its hf:// revision replaced by a commit, and the status.model that records
    it; other sources are returned unchanged (and no status). SpecError naming
    spec.model.revision when the revision cannot be resolved."""
    model = spec.model
    if model.source.scheme != "hf":
        return spec, None
    requested = model.revision or DEFAULT_REVISION
    before = previous or {}
    if COMMIT.fullmatch(requested):
        commit = requested
    elif (
        before.get("source") == model.uri
        and before.get("revision") == requested
        and COMMIT.fullmatch(str(before.get("commit", "")))
    ):
        commit = str(before["commit"])  # pinned by an earlier pass: never moves on its own
    else:
        commit = _resolve(resolver, model.source.path, requested, model.uri)
    pinned = dataclasses.replace(spec, model=dataclasses.replace(model, revision=commit))
    return pinned, {"source": model.uri, "revision": requested, "commit": commit}


def _resolve(resolver: Resolver, repo: str, revision: str, uri: str) -> str:
    try:
        commit = resolver(repo, revision)
    except Exception as exc:  # the Hub client raises many kinds; each says why
        raise SpecError(
            f"spec.model.revision: cannot resolve {revision!r} of {uri} to a commit "
            f"({type(exc).__name__}: {str(exc)[:300]}); nothing is rendered until it resolves "
            "(retried every pass), or pin a commit sha",
            "spec.model.revision",
        ) from exc
    if not COMMIT.fullmatch(commit):
        raise SpecError(
            f"spec.model.revision: the Hub answered {commit[:60]!r} for {revision!r} of {uri}, "
            "not a commit sha",
            "spec.model.revision",
        )
    return commit
