"""The one base class of errors meant for the user.

Every layer raises a subclass of `CompletionError` for input it refuses (a model it
cannot load, a prompt that does not fit, a setting the model lacks): the message says
what was wrong and what to do, so the daemon passes it to the editor as it is. Anything
else that escapes a request is a bug and is reported as an internal error instead.

No imports: every layer (models included) may use this module.
"""

from __future__ import annotations


class CompletionError(Exception):
    """A request, setting or model that cannot be served, with a message meant for the user."""


class EngineError(CompletionError):
    """A request or model the engine refuses, with a message meant for the user (defined here, below the
    engine's modules, so engine/native can raise it without importing engine.py)."""
