"""etcd registry (aetcd, asyncio): lease + keep-alive registration, load publishing, watch.

Registration never blocks serving: `register` stores the record and a background task
keeps it in etcd, granting a lease of `ttl` seconds, refreshing it every ttl/3 and, when
etcd is away or the lease was lost, retrying with a fresh lease (and logging once per
outage). `watch` yields a snapshot, then events; when the watch breaks it re-snapshots.
TLS and credentials (`EtcdAccess`, cluster/discovery/etcd_access.py) go to the client
(cluster/discovery/etcd_client.py); failures are logged with the flag that would fix them.

Load records are written only when they changed (NodeLoad.same_as ignores the time of
measurement) and at most once per `min_load_interval`; a change inside the interval goes
out at its end (the latest value wins). etcd keeps every revision until compaction, and
the old fixed-rate rewrite of a ~62 KB record (7.9 revisions/s per idle node) grew the
database by ~0.5 MB/s. Liveness needs no load heartbeat: the lease keep-alive proves it,
and keep-alives create no revisions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from cluster.discovery.etcd_access import EtcdAccess, describe_etcd_error
from cluster.discovery.records import (
    NodeLoad,
    NodeRecord,
    cluster_prefix,
    load_key,
    node_key,
    parse_key,
)
from cluster.discovery.registry import Registry, WatchEvent

log = logging.getLogger("cluster.discovery")

RETRY_S = 1.0
MIN_LOAD_INTERVAL_S = 1.0


def _items(spec: str | list[str]) -> list[str]:
    return [i.strip() for i in (spec.split(",") if isinstance(spec, str) else list(spec))]


def parse_endpoints(spec: str | list[str]) -> list[tuple[str, int]]:
    """'h1:2379,https://h2:2379' -> [('h1', 2379), ('h2', 2379)] (ValueError names a bad
    one). The scheme, if any, only says whether TLS is expected: `endpoint_schemes`."""
    out = []
    for item in _items(spec):
        item = item.removeprefix("http://").removeprefix("https://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must be HOST:PORT, got {item!r}")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def endpoint_schemes(spec: str | list[str]) -> set[str]:
    """The schemes written in `spec` ('http', 'https'; none for bare HOST:PORT)."""
    return {i.split("://", 1)[0] for i in _items(spec) if "://" in i}


def resolve_access(endpoints: str | list[str], access: EtcdAccess | None) -> EtcdAccess:
    """`access`, with TLS turned on by https:// endpoints; a ValueError when the endpoints
    and the TLS options disagree (one client dials every endpoint the same way)."""
    access = access or EtcdAccess()
    schemes = endpoint_schemes(endpoints)
    if schemes == {"http", "https"}:
        raise ValueError(f"etcd endpoints {endpoints!r} mix http:// and https://")
    if "http" in schemes and access.tls:
        raise ValueError(f"etcd endpoints {endpoints!r} say http:// but --etcd-ca/--etcd-cert "
                         f"ask for TLS; write https:// or HOST:PORT")
    return replace(access, tls=True) if "https" in schemes else access


class EtcdRegistry(Registry):
    def __init__(self, endpoints: str | list[str], cluster: str = "default", ttl: int = 5,
                 timeout: float = 3.0, min_load_interval: float = MIN_LOAD_INTERVAL_S,
                 access: EtcdAccess | None = None):
        """access: TLS files and user/password for etcd (None: plaintext, no auth)."""
        super().__init__(cluster)
        if ttl < 1:
            raise ValueError(f"lease ttl must be >= 1 s, got {ttl}")
        self.endpoints = parse_endpoints(endpoints)
        self.access = resolve_access(endpoints, access)
        self.ttl = ttl
        self.timeout = timeout
        self.min_load_interval = min_load_interval
        self.load_puts = 0                      # load writes sent to etcd (tests, logs)
        self._published: NodeLoad | None = None  # the load etcd holds under our lease
        self._last_put = float("-inf")
        self._flush: asyncio.Task | None = None
        self._client = None
        self._endpoint_idx = 0
        self._record: NodeRecord | None = None
        self._load: NodeLoad | None = None
        self._lease = None
        self._keeper: asyncio.Task | None = None
        self._registered = asyncio.Event()

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    # ---- connection ----------------------------------------------------------------
    async def _connect(self):
        from cluster.discovery.etcd_client import make_client  # imports aetcd, grpc

        if self._client is None:
            host, port = self.endpoints[self._endpoint_idx % len(self.endpoints)]
            self._client = make_client(host, port, self.access, timeout=self.timeout)
        return self._client

    def _why(self, exc: BaseException) -> str:
        return describe_etcd_error(exc, self._where(), self.access)

    async def _drop_client(self) -> None:
        """Forget a broken connection and move on to the next endpoint."""
        client, self._client = self._client, None
        self._endpoint_idx += 1
        if client is not None:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - already broken
                pass

    def _where(self) -> str:
        host, port = self.endpoints[self._endpoint_idx % len(self.endpoints)]
        return f"{host}:{port}"

    # ---- node side -----------------------------------------------------------------
    async def register(self, record: NodeRecord) -> None:
        self._record = record
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep_registered(),
                                               name=f"etcd-keepalive-{record.node_id}")

    async def wait_registered(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._registered.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _put_record(self) -> None:
        client = await self._connect()
        rec = self._record
        self._lease = await client.lease(self.ttl)
        await client.put(node_key(self.cluster, rec.role, rec.node_id).encode(),
                         rec.to_json(), lease=self._lease)
        self._published = None          # a new lease starts without our load key
        if self._load is not None:
            load = self._load
            await client.put(load_key(self.cluster, rec.role, rec.node_id).encode(),
                             load.to_json(), lease=self._lease)
            self._published, self._last_put = load, time.monotonic()
            self.load_puts += 1

    async def _keep_registered(self) -> None:
        outage = False
        while self._record is not None:
            try:
                if self._lease is None:
                    await self._put_record()
                    self._registered.set()
                    log.info("registered %s at %s in etcd %s (lease %x, ttl %ds)",
                             self._record.key, self._record.address, self._where(),
                             self._lease.id, self.ttl)
                    outage = False
                await asyncio.sleep(self.ttl / 3)
                reply = await self._client.refresh_lease(self._lease.id)
                if reply is None or reply.TTL <= 0:
                    log.warning("etcd lease of %s expired; registering again",
                                self._record.key)
                    self._lease = None
                    self._registered.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: keep serving, retry
                self._registered.clear()
                self._lease = None
                if not outage:
                    log.warning("%s; node keeps serving, retrying registration every "
                                "%.0fs", self._why(exc), RETRY_S)
                    outage = True
                await self._drop_client()
                await asyncio.sleep(RETRY_S)

    async def publish_load(self, load: NodeLoad) -> None:
        """Remember `load`; write it now, later (rate bound) or never (unchanged)."""
        self._load = load
        if self._record is None or self._lease is None or self._client is None:
            return      # (re-)registration writes the latest load with the record
        if load.same_as(self._published):
            return
        if self._flush is not None and not self._flush.done():
            return      # a write is due already; it takes the latest load
        wait = self._last_put + self.min_load_interval - time.monotonic()
        if wait <= 0:
            await self._put_load()
        else:
            self._flush = asyncio.create_task(self._put_load(after=wait),
                                              name="etcd-load-flush")

    async def _put_load(self, after: float = 0.0) -> None:
        if after > 0:
            await asyncio.sleep(after)
        # Never two writes within the interval: a direct write may have landed while this
        # flush slept (seen under load: 8 writes in 2.5 s against a 0.5 s bound).
        while (wait := self._last_put + self.min_load_interval - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        load, lease, client, rec = self._load, self._lease, self._client, self._record
        if load is None or lease is None or client is None or rec is None:
            return
        if load.same_as(self._published):
            return      # changed and changed back within the interval
        self._last_put = time.monotonic()
        try:
            await client.put(load_key(self.cluster, rec.role, rec.node_id).encode(),
                             load.to_json(), lease=lease)
            self._published = load
            self.load_puts += 1
        except Exception as exc:  # noqa: BLE001 - the keep-alive task handles outages
            log.debug("load publish failed: %s", exc)

    async def _cancel_flush(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            await asyncio.gather(self._flush, return_exceptions=True)
            self._flush = None

    async def deregister(self) -> None:
        record, self._record = self._record, None
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        await self._cancel_flush()
        lease, self._lease = self._lease, None
        self._published = None
        self._registered.clear()
        if record is None or self._client is None:
            return
        try:
            if lease is not None:
                await self._client.revoke_lease(lease.id)   # deletes both keys at once
            else:
                await self._client.delete(node_key(self.cluster, record.role,
                                                   record.node_id).encode())
            log.info("deregistered %s from etcd", record.key)
        except Exception as exc:  # noqa: BLE001 - the lease will expire on its own
            log.warning("deregistering %s failed (%s); its lease expires within %ds",
                        record.key, exc, self.ttl)

    # ---- router side ---------------------------------------------------------------
    async def snapshot(self) -> tuple[dict[str, NodeRecord], dict[str, NodeLoad]]:
        nodes, loads, _ = await self._snapshot_with_revision()
        return nodes, loads

    async def _snapshot_with_revision(self):
        client = await self._connect()
        result = await client.get_prefix(cluster_prefix(self.cluster).encode())
        nodes: dict[str, NodeRecord] = {}
        loads: dict[str, NodeLoad] = {}
        for kv in result:
            self._apply(kv.key.decode(), kv.value, nodes, loads)
        return nodes, loads, result.header.revision

    def _apply(self, key: str, value: bytes, nodes: dict, loads: dict) -> WatchEvent | None:
        parsed = parse_key(self.cluster, key)
        if parsed is None:
            return None
        kind, role, node_id = parsed
        try:
            if kind == "nodes":
                nodes[f"{role}/{node_id}"] = rec = NodeRecord.from_json(value)
                return WatchEvent("put", role, node_id, record=rec)
            loads[f"{role}/{node_id}"] = load = NodeLoad.from_json(value)
            return WatchEvent("load", role, node_id, load=load)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed etcd value at %s: %s", key, exc)
            return None

    async def watch(self) -> AsyncIterator[WatchEvent]:
        outage = False
        while True:
            try:
                nodes, loads, revision = await self._snapshot_with_revision()
                yield WatchEvent("snapshot", nodes=nodes, loads=loads)
                if outage:
                    log.info("etcd %s is back; cluster view resynchronised", self._where())
                    outage = False
                watch = await self._client.watch_prefix(cluster_prefix(self.cluster).encode(),
                                                        start_revision=revision + 1)
                async for ev in watch:
                    key = ev.kv.key.decode()
                    if ev.kind == "DELETE":
                        parsed = parse_key(self.cluster, key)
                        if parsed is not None and parsed[0] == "nodes":
                            yield WatchEvent("delete", parsed[1], parsed[2])
                        continue
                    out = self._apply(key, ev.kv.value, {}, {})
                    if out is not None:
                        yield out
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: retry, then re-snapshot
                if not outage:
                    log.warning("etcd watch broke: %s; retrying every %.0fs",
                                self._why(exc), RETRY_S)
                    outage = True
                await self._drop_client()
                await asyncio.sleep(RETRY_S)

    async def close(self) -> None:
        await self._cancel_flush()
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        if self._client is not None:
            await self._drop_client()
