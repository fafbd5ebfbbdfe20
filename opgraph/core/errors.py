"""The one exception type the CLI turns into a one-line message and exit status 2."""


class OpgraphError(Exception):
    """Bad input from a user: a file, a flag or an argument. The message says what to do."""
