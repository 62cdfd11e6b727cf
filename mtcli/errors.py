"""The one exception type users see: the CLI prints its message on one line and exits with status 2."""


class MtcliError(Exception):
    """Bad input or a state the user can fix; the message says what is wrong and what to do."""
