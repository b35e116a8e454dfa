"""Parsed update rules by their JSON text: a push names its rule, the PS parses it once.

Every push carries its update rule as canonical JSON (the learning rate at the
pusher's step included).  Parsing it per push would add a ``json.loads`` and a
rule construction to the PS's per-push CPU, its measured bottleneck; a constant
rate sends the same text every time, so the parsed rule is kept by text and a
push costs one dict lookup.  A schedule sends a new text every step: the cache
is bounded and forgets its oldest entries.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from psflow.errors import InvalidArgumentError
from psflow.update_rules import UpdateRule, rule_from_config

from .names import quote

__all__ = ["MAX_RULE_JSON", "RuleCache", "parse_config"]

# Larger than any real rule config (a few hundred characters), small enough
# that a hostile text costs little to reject.
MAX_RULE_JSON = 64 << 10


class RuleCache:
    """Parses rule JSON once per distinct text; thread-safe, at most ``size`` entries.

    Example:
        >>> cache = RuleCache()
        >>> rule = cache.get('{"learning_rate": 0.5, "name": "sgd"}')
        >>> rule is cache.get('{"learning_rate": 0.5, "name": "sgd"}')
        True
    """

    def __init__(self, size: int = 64) -> None:
        self.size = int(size)
        self._rules: OrderedDict[str, UpdateRule] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> UpdateRule:
        """The rule ``text`` describes.

        Raises:
            InvalidArgumentError: too long, not JSON, not an object, or not a
                valid rule config (the text is quoted).
        """
        rule = self._rules.get(text)  # the common case: no lock, no parse
        if rule is not None:
            return rule
        rule = _parse(text)
        with self._lock:
            self._rules[text] = rule
            while len(self._rules) > self.size:
                self._rules.popitem(last=False)
        return rule


def parse_config(text: str, what: str) -> dict[str, Any]:
    """``text``, a JSON object of at most :data:`MAX_RULE_JSON` characters (an update
    rule's or an optimizer's config), as a dict.

    Raises:
        InvalidArgumentError: too long, too deeply nested, not JSON or not an object
            (the message starts with ``what``).
    """
    if len(text) > MAX_RULE_JSON:
        raise InvalidArgumentError(
            f"{what} is {len(text)} characters, above the limit of {MAX_RULE_JSON}"
        )
    try:
        config = json.loads(text)
    except RecursionError as e:
        raise InvalidArgumentError(f"{what} is nested too deeply: {quote(text)}") from e
    except ValueError as e:  # not JSON, or an integer of more digits than Python converts
        raise InvalidArgumentError(f"{what} is not JSON ({e}): {quote(text)}") from e
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{what} is not an object: {quote(text)}")
    return config


def _parse(text: str) -> UpdateRule:
    return rule_from_config(parse_config(text, "update rule of a push"))
