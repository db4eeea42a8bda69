"""The metric/event bus: node managers publish, aggregators consume (ARCHITECTURE §2, §7, §8).

- :mod:`.messages`  versioned message schemas, topics, keys, JSON wire form (single messages and
  bundles), :class:`MalformedMessage`
- :mod:`.base`      the :class:`MetricBus` / :class:`BusConsumer` role and :class:`Record`
- :mod:`.inprocess` :class:`InProcessBus`, the embedded mode's adapter
- :mod:`.kafka`     :class:`KafkaMetricBus`, the cluster mode's adapter (needs kafka-python; import it
  from its module so the embedded mode does not)
- :mod:`.batcher`   :class:`LocalBatcher`, a node manager's count/age batching in front of a bus
- :mod:`.tansu`     start a throw-away Tansu broker for tests and demos
"""

from stagetree.bus.base import BusConsumer, Malformed, MetricBus, Record
from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import (
    MalformedMessage,
    Message,
    UnsupportedVersion,
    decode,
    decode_many,
    encode,
    encode_many,
    route,
)

__all__ = [
    "BusConsumer",
    "InProcessBus",
    "LocalBatcher",
    "Malformed",
    "MalformedMessage",
    "Message",
    "MetricBus",
    "Record",
    "UnsupportedVersion",
    "decode",
    "decode_many",
    "encode",
    "encode_many",
    "route",
]
