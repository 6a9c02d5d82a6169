"""API keys and tenants: each key is one broker owner, with its own AsyncClient (its own connection and
owner token), so the broker's ownership rules keep one tenant from cancelling or subscribing to another's
jobs. Without keys every request runs under the gateway's own owner."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from tokenmill.client import AsyncClient
from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.errors import APIError


def owner_of_key(key: str) -> str:
    """The broker owner token of an API key: a hash, so the key itself never travels to the broker."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:40]


class Tenants:
    """Checks bearer tokens and hands out one AsyncClient per tenant (created on first use)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self._keys = [k.encode() for k in cfg.api_keys]
        self.default_owner = "gateway-" + secrets.token_hex(12)
        self._clients: dict[str, AsyncClient] = {}

    @property
    def auth_required(self) -> bool:
        return bool(self._keys)

    def owner_for(self, authorization: str | None) -> str:
        """The owner of a request's `Authorization` header; 401 for a missing or unknown key."""
        if not self._keys:
            return self.default_owner
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        # compare_digest against every key: the time taken does not depend on which one matched
        matched = [k for k in self._keys if hmac.compare_digest(k, given)]
        if scheme.lower() != "bearer" or not matched:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        return owner_of_key(matched[0].decode())

    def client(self, owner: str) -> AsyncClient:
        c = self._clients.get(owner)
        if c is None:
            c = AsyncClient(self.cfg.broker, owner=owner, timeout=self.cfg.request_timeout,
                            curve_server_key=self.cfg.curve_server_key, curve_secret_key=self.cfg.curve_secret_key)
            self._clients[owner] = c
        return c

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
