"""tokenmill broker (torch-free): distributes token-streaming jobs from clients to worker processes."""

from tokenmill.broker.broker import Broker, BrokerConfig

__all__ = ["Broker", "BrokerConfig"]
