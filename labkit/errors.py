"""Named errors at labkit's public boundaries.

Each maps to one HTTP status in the service, so a caller can refuse a request before the first
byte of a stream by catching the class rather than parsing a message.
"""

from __future__ import annotations


class LabkitError(Exception):
    """Base class for every error labkit raises on purpose."""


class InvalidRequest(LabkitError, ValueError):
    """A request that can never be served as written (HTTP 422)."""


class EmptyPrompt(InvalidRequest):
    """The prompt has no tokens."""


class PromptTooLong(InvalidRequest):
    """Prompt plus max_new_tokens exceeds the model's context or the whole KV cache."""


class QueueFull(LabkitError):
    """The waiting list is at its limit; try again later (HTTP 429)."""


class DoubleFree(LabkitError, RuntimeError):
    """Blocks released twice: a bookkeeping bug, never a user error."""


class CacheFull(LabkitError, RuntimeError):
    """More blocks asked of the KV cache than are free. The scheduler checks before it allocates,
    so reaching this is a bookkeeping bug, never a user error (a client sees QueueFull or waits)."""


class UnknownModel(LabkitError, ValueError):
    """A model name or path labkit cannot load."""
