"""The ``usage:`` section: prices of GPU time per node class, for usage accounting (what is
accounted and when: :mod:`opentinker_scheduler.state.usage`).

.. code-block:: yaml

    usage:
      currency: USD                 # the unit `cost` is in (a label only)
      default_node_class: on-demand # the class of a node that announces none (--node-class)
      prices:                       # per GPU-hour, by node class; a class not listed costs 0
        on-demand: 2.50
        spot: 0.90
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The class of nodes that announce none, when the config names no other.
DEFAULT_NODE_CLASS = "default"


def check_node_class(name: str) -> str | None:
    """What is wrong with a node class name (None: fine): 1..64 letters, digits, ``-_.``."""
    if not 1 <= len(name) <= 64 or not all(c.isalnum() or c in "-_." for c in name):
        return "a node class of 1 to 64 letters, digits, '-', '_' or '.'"
    return None


@dataclass(frozen=True)
class UsageConfig:
    currency: str = "USD"
    default_node_class: str = DEFAULT_NODE_CLASS
    #: node class -> price per GPU-hour.
    prices: dict[str, float] = field(default_factory=dict)

    def price(self, node_class: str) -> float:
        """Price per GPU-hour of ``node_class`` (0 when not listed)."""
        return self.prices.get(node_class, 0.0)

    def __hash__(self) -> int:  # frozen with a dict field: hash by value
        return hash((self.currency, self.default_node_class, tuple(sorted(self.prices.items()))))


def parse_usage(r, node) -> UsageConfig:
    """Parse the ``usage:`` mapping with the config reader ``r`` (file:line:key errors).

    Raises:
        ConfigError: unknown key, wrong type, a bad class name or a negative price (via ``r``).
    """
    m = r.mapping(node, "usage", {"currency": "", "default_node_class": "", "prices": ""})
    kw: dict = {}
    if "currency" in m:
        currency = r.scalar(m["currency"][1], "usage.currency", str)
        if not 1 <= len(currency) <= 16:
            raise r.fail(m["currency"][1], "usage.currency", "a currency label of 1 to 16 characters")
        kw["currency"] = currency
    if "default_node_class" in m:
        name = r.scalar(m["default_node_class"][1], "usage.default_node_class", str)
        bad = check_node_class(name)
        if bad:
            raise r.fail(m["default_node_class"][1], "usage.default_node_class", f"{bad}, got {name!r}")
        kw["default_node_class"] = name
    if "prices" in m:
        pnode = m["prices"][1]
        import yaml

        if not isinstance(pnode, yaml.MappingNode):
            raise r.fail(pnode, "usage.prices", "a mapping of node class -> price per GPU-hour")
        prices: dict[str, float] = {}
        for k, v in pnode.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else ""
            bad = check_node_class(name)
            if bad:
                raise r.fail(k, "usage.prices", f"{bad}, got {name!r}")
            if name in prices:
                raise r.fail(k, f"usage.prices.{name}", "each node class once; duplicate key")
            prices[name] = r.scalar(v, f"usage.prices.{name}", float, 0, 1e6)
        kw["prices"] = prices
    return UsageConfig(**kw)
