"""A request body from bytes to a checked JSON object, then to its pydantic model.

Run in a preparation lane (lanes.py), never on the event loop: parsing and validating a
4 MiB body holds the GIL for tens of milliseconds. Every failure is a 400 naming what is wrong:
malformed JSON, nesting beyond the cap (the parser's own recursion limit used to surface as a
500), a string holding a lone UTF-16 surrogate (JSON's \\ud800 escapes decode to those, and no
tokenizer or UTF-8 answer can carry one), a field failing validation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gearshift.operator.router import errors

M = TypeVar("M", bound=BaseModel)


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(path: str) -> errors.APIError:
    return errors.bad_request(
        f"{path}: a string holds a lone UTF-16 surrogate", path.split(".")[0] if path else None
    )


def check_structure(value: Any, max_depth: int) -> None:
    """Refuse nesting deeper than `max_depth` and the first string with a lone surrogate
    (a key's surrogate is reported at the object holding it)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if not _utf8(item):
                raise _surrogate(path)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= max_depth:
            raise errors.bad_request(
                f"the JSON body nests deeper than {max_depth} levels of arrays and objects",
                path.split(".")[0] or None,
                "limit_exceeded",
            )
        pairs: Any = item.items() if isinstance(item, dict) else enumerate(item)
        children = []
        for key, child in pairs:
            if isinstance(key, str) and not _utf8(key):
                raise _surrogate(path or "body")
            if isinstance(child, (str, dict, list)):
                children.append((child, f"{path}.{key}" if path else str(key), depth + 1))
        stack.extend(reversed(children))  # depth first, in document order


def parse_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, checked by `check_structure`."""
    if not raw.strip():
        raise errors.bad_request("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise errors.bad_request(
            f"the JSON body nests deeper than {max_depth} levels of arrays and objects",
            None,
            "limit_exceeded",
        ) from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes not UTF-8
        raise errors.bad_request(f"malformed JSON body: {errors.clip(exc, 200)}") from None
    if not isinstance(data, dict):
        raise errors.bad_request("the request body must be a JSON object")
    check_structure(data, max_depth)
    return data


def validate(model: type[M], data: Mapping[str, Any]) -> M:
    """`data` as `model`; the first validation error becomes a 400 naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_context=False)[0]
        raise errors.invalid_field(first.get("loc", ()), str(first.get("msg"))) from None
