"""Token checks as another package would register them (docs/grammar.md
shows the same two): the tests install them through the entry-point group
``vllm_plugins.grammar_checks``."""

BANNED = ("bad", "word")


def banned_words(text: str, token: str) -> bool:
    """No banned word anywhere in the output: the text with the token may
    not contain one (one spanning the boundary counts)."""
    tail = text[-max(map(len, BANNED)):] + token
    return not any(w in tail for w in BANNED)


def digits_until_newline(text: str, token: str) -> bool:
    """Only digits until the first newline; anything after it."""
    if "\n" in text:
        return True
    head = token.split("\n", 1)[0]
    return head.isdigit() or head == "" and token.startswith("\n") and text != ""
