"""The one exception type users see: the CLI prints its message on one line and exits with status 2."""


class MtcliError(Exception):
    """Bad input or a state the user can fix; the message says what is wrong and what to do."""


def error_text(error: BaseException, limit: int = 200) -> str:
    """An exception's message for a one-line error: whitespace folded, at most `limit` characters, its type's name
    when it has none."""
    return " ".join(str(error).split())[:limit] or type(error).__name__
