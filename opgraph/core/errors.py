"""The one exception type the CLI turns into a one-line message and exit status 2, and the hint
such a message gives for a mistyped id (`did_you_mean`)."""


class OpgraphError(Exception):
    """Bad input from a user: a file, a flag or an argument. The message says what to do."""


def did_you_mean(name: str, choices) -> str:
    """The hint ` (did you mean X?)` for a mistyped id: the choices that begin with it, whatever the
    case (`H100` -> the H100 parts), else the nearest by spelling (difflib's ratio at 0.6 or
    more, `llama-3-8b` -> `llama3-8b`, the nearest first); "" where none is near."""
    import difflib

    wanted = name.strip().lower()
    if not wanted:
        return ""
    choices = list(choices)
    near = [c for c in choices if c.lower().startswith(wanted)]
    if not near:
        by_lower = {c.lower(): c for c in choices}
        near = [by_lower[c] for c in difflib.get_close_matches(wanted, list(by_lower), n=3)]
    if not near:
        return ""
    return f" (did you mean {' or '.join(near[:3])}?)"
