"""The etcd client: aetcd's, with TLS.

aetcd 1.0 has no TLS options: `aetcd.Client.connect` always dials
`grpc.aio.insecure_channel`. `EtcdClient` overrides `connect` only, to open a
`grpc.aio.secure_channel` with `grpc.ssl_channel_credentials(ca, key, cert)` when TLS is on;
what follows the channel (authentication, stubs, the watcher) repeats aetcd's own steps,
because aetcd builds them inline in the same method. Every other method is aetcd's.
Credentials and their checks: cluster/discovery/etcd_access.py.
"""

from __future__ import annotations

import asyncio
import logging

import aetcd
from aetcd import rpc
from aetcd import watcher as aetcd_watcher
from aetcd.client import _handle_errors

from cluster.discovery.etcd_access import EtcdAccess

log = logging.getLogger("cluster.discovery")


class EtcdClient(aetcd.Client):
    """aetcd.Client that dials with TLS when `access.tls`; see the module docstring."""

    def __init__(self, host: str, port: int, access: EtcdAccess, timeout: float | None = None):
        super().__init__(host=host, port=port, username=access.user,
                         password=access.password, timeout=timeout)
        self._tls = access.channel_credentials() if access.tls else None

    @_handle_errors
    async def connect(self) -> None:
        if self._tls is None:
            return await super().connect()
        if self._connected.is_set():
            return
        if self._is_connecting:         # another task is connecting: wait for it (as aetcd)
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            # The one change: a TLS channel. The name checked in etcd's certificate is the
            # host dialed (an IP needs an IP SAN), as any etcd client does.
            self.channel = rpc.secure_channel(target, self._tls,
                                              options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd_watcher.Watcher(rpc.WatchStub(self.channel),
                                                  timeout=self._timeout,
                                                  metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(host: str, port: int, access: EtcdAccess | None,
                timeout: float | None = None) -> aetcd.Client:
    access = access or EtcdAccess()
    if access.user and not access.tls:
        log.warning("etcd user/password over a plaintext link to %s:%d: the password "
                    "crosses the network in clear (give --etcd-ca for TLS)", host, port)
    return EtcdClient(host, port, access, timeout=timeout)


__all__ = ["EtcdClient", "make_client"]
