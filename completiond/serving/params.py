"""Reading a wire method's params: the type each one must have, and how a bad one is worded."""

from __future__ import annotations

from typing import Any


def int_param(params: dict[str, Any], key: str) -> int:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an integer, got {type(value).__name__}")
    return value


def str_param(params: dict[str, Any], key: str) -> str:
    value = params[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {type(value).__name__}")
    return value


def reason(exc: BaseException) -> str:
    return f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
