"""The prefix-cache salt of a request (vLLM's `cache_salt`), and salting by API key.

A salt goes into the hash of a request's first KV block (worker/kv/block_manager.py), so
requests with different salts never share cached blocks, and `cached_tokens` cannot tell one
client whether another's prompts began like its own. With `cacheSaltByApiKey` (router
`--cache-salt-by-api-key`) the router salts every request by the API key it came with: each key
gets its own prefix cache, and a client's own `cache_salt` only divides its key's cache further.
Workers see a digest of the key, never the key.
"""

from __future__ import annotations

import hashlib

from gearshift.operator.router import errors
from gearshift.operator.router.protocol import MAX_CACHE_SALT_LENGTH

# Where the API key middleware leaves the key's salt for the request (Starlette request.state).
STATE_KEY = "cache_salt"


def key_salt(api_key: str) -> str:
    """A salt that stands for `api_key` (its SHA-256, domain-separated; the key stays here)."""
    return hashlib.sha256(b"gearshift-cache-salt\0" + api_key.encode()).hexdigest()


def check(salt: object, field: str = "cache_salt") -> str | None:
    """A client's cache_salt as vLLM takes it: a non-empty string (None: not given)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise errors.bad_request(f"{field} must be a non-empty string if provided", field)
    if len(salt) > MAX_CACHE_SALT_LENGTH:
        raise errors.bad_request(
            f"{field} must be at most {MAX_CACHE_SALT_LENGTH} characters, got {len(salt)}", field
        )
    return salt


def combine(client: str | None, key: str | None) -> str:
    """The salt the worker hashes: the key's, then the client's under it; "" for neither."""
    if key and client:
        return f"{key}:{client}"
    return key or client or ""
