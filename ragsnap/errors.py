"""User-facing errors: raised for bad input, shown as one clear line, never a traceback."""


class RagSnapError(Exception):
    """Base class for errors caused by what the user asked for (bad input, bad config).

    ``field`` names the offending input where there is one, so the CLI and the API can
    point at it (``--budget``, ``compression.budget``, ``documents[2].text``...).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class InputError(RagSnapError):
    """The request itself is invalid (empty question, unreadable document...)."""


class ConfigError(RagSnapError):
    """A compression or generation setting is invalid (unknown press, budget < window...)."""


class ModelLoadError(RagSnapError):
    """The model could not be found or loaded."""


class KVMemoryError(InputError):
    """A request needs more KV memory than the server has in all (HTTP 413)."""

    status = 413
