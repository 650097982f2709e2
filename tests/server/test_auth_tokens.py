"""Control-plane tokens (worker/server/auth.py): fail closed without a token, rotation through
the token file with a grace window for the old token, and what a server accepts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gearshift.worker.server import auth


def _rotate(path: Path, token: str) -> None:
    """Replace the file the way the kubelet updates a mounted Secret: a new file, renamed in."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(token)
    os.replace(tmp, path)


def _wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_server_without_a_token_refuses_to_start_unless_told_insecure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(auth.TokenError, match="--insecure-no-auth"):
        auth.interceptors(None, "worker g0")
    with pytest.raises(auth.TokenError, match="no token configured"):
        auth.interceptors("", "admin")
    assert auth.interceptors(None, "worker g0", insecure_no_auth=True) == []
    assert "NOT authenticated" in caplog.text
    assert len(auth.interceptors("t0ken", "worker g0")) == 1


def test_a_rotated_file_is_picked_up_and_the_old_token_accepted_for_the_grace_window(
    tmp_path: Path,
) -> None:
    path = auth.write_token(tmp_path / "token", "old-token")
    source = auth.TokenSource.from_file(path, grace_s=0.5)
    source.recheck_s = 0.0
    assert source.tokens() == ("old-token",)
    _rotate(path, "new-token\n")
    assert source.tokens() == ("new-token", "old-token")  # current first, then the old one
    # A client presents both; a server that has not seen the file yet still admits it.
    assert auth.call_metadata(source) == (
        ("authorization", "Bearer new-token"),
        ("authorization", "Bearer old-token"),
    )
    assert auth.authorized(auth.call_metadata(source), ["old-token"])
    _wait_for(lambda: source.tokens() == ("new-token",), 5)
    assert not auth.authorized((("authorization", "Bearer old-token"),), source.tokens())


def test_an_emptied_or_missing_file_keeps_the_token_in_use(tmp_path: Path) -> None:
    path = auth.write_token(tmp_path / "token", "kept")
    source = auth.TokenSource.from_file(path)
    source.recheck_s = 0.0
    _rotate(path, "  \n")
    assert source.tokens() == ("kept",)  # a blank token never becomes the one accepted
    path.unlink()
    assert source.tokens() == ("kept",)
    with pytest.raises(auth.TokenError, match="empty"):
        auth.TokenSource.from_file(auth.write_token(tmp_path / "blank", " "))


def test_the_file_is_checked_at_most_once_per_recheck_interval(tmp_path: Path) -> None:
    path = auth.write_token(tmp_path / "token", "a")
    source = auth.TokenSource.from_file(path)
    source.recheck_s = 3600.0
    _rotate(path, "b")
    assert source.tokens() == ("a",)  # not re-read on every call: a stat() per interval


@pytest.mark.parametrize(
    ("metadata", "ok"),
    [
        ((("authorization", "Bearer right"),), True),
        ((("authorization", "bearer right"),), True),
        ((("authorization", "Bearer wrong"),), False),
        ((("authorization", "Bearer "),), False),
        ((("authorization", "right"),), False),
        ((("authorization", "Basic right"),), False),
        ((), False),
        (None, False),
        # Only the first two presented tokens count: no brute force by piling them up.
        (
            (
                ("authorization", "Bearer x0"),
                ("authorization", "Bearer x1"),
                ("authorization", "Bearer right"),
            ),
            False,
        ),
        ((("authorization", "Bearer wrong"), ("authorization", "Bearer right")), True),
    ],
)
def test_what_a_server_accepts(metadata: object, ok: bool) -> None:
    assert auth.authorized(metadata, ["right"]) is ok
    assert auth.authorized(metadata, [""]) is False  # an empty token never authenticates
