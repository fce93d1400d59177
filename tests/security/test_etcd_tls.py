"""TLS and authentication between the cluster's processes and etcd (issue 13): a real etcd
on 127.0.0.1 serving https only with `--client-cert-auth` (launch/etcd_server.py, as
`pdserve up` starts it), and the registry every process uses (cluster/discovery/etcd.py
over cluster/discovery/etcd_client.py).

Served: a client with the CA and a client certificate registers, and another one watching
sees it. Refused, each with an error naming the flag to fix: a plaintext client, a client
without a certificate, a client whose certificate another CA signed, and (etcd auth on) a
wrong password. The flags are the same on router, prefill and decode, and `pdserve up`
wires them from its throw-away CA.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.discovery import ClusterView, EtcdRegistry, NodeRecord
from cluster.discovery.etcd import resolve_access
from cluster.discovery.etcd_access import EtcdAccess, describe_etcd_error
from cluster.discovery.etcd_client import make_client
from cluster.tls import write_cluster_certs
from launch.cli import build_parser
from launch.cli_common import CliError, etcd_access_from_args
from launch.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    base = tmp_path_factory.mktemp("etcd-tls")
    good = write_cluster_certs(base / "cluster", ["etcd", "node"])
    rogue = write_cluster_certs(base / "rogue", ["node"])["node"]
    return {"etcd": good["etcd"], "node": good["node"], "rogue": rogue}


@pytest.fixture(scope="module")
def etcd(certs, tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data", tls=certs["etcd"]).start()
    try:
        yield server
    finally:
        server.stop()


def _access(tls, with_cert: bool = True, **kw) -> EtcdAccess:
    return EtcdAccess(ca=tls.ca, cert=tls.cert if with_cert else None,
                      key=tls.key if with_cert else None, **kw)


async def _refusal(etcd, access: EtcdAccess) -> str:
    host, port = etcd.endpoint.split(":")
    client = make_client(host, int(port), access, timeout=3)
    try:
        with pytest.raises(Exception) as info:       # noqa: PT011 - aetcd's own classes
            await client.get(b"/pdserve/x")
    finally:
        await client.close()
    return describe_etcd_error(info.value, etcd.endpoint, access)


def test_a_client_with_a_cluster_certificate_registers_and_watches(etcd, certs):
    async def main():
        node = EtcdRegistry(etcd.endpoint, "tls", ttl=3, access=_access(certs["node"]))
        view = ClusterView(EtcdRegistry(f"https://{etcd.endpoint}", "tls",
                                        access=_access(certs["node"])))
        await view.start()
        try:
            await node.register(NodeRecord("d1", "decode", "127.0.0.1:1", "i1"))
            assert await node.wait_registered(10)
            for _ in range(100):
                if [r.node_id for r in view.nodes()] == ["d1"]:
                    break
                await asyncio.sleep(0.05)
            assert [r.node_id for r in view.nodes()] == ["d1"]
            await node.deregister()
            for _ in range(100):
                if not view.nodes():
                    break
                await asyncio.sleep(0.05)
            assert view.nodes() == []
        finally:
            await view.close()
            await node.close()
    asyncio.run(main())


def test_clients_without_the_right_certificate_are_refused_with_a_clear_error(etcd, certs,
                                                                           caplog):
    async def main():
        why = {
            "plaintext": await _refusal(etcd, EtcdAccess()),
            "no client certificate": await _refusal(etcd, _access(certs["node"], False)),
            "another CA's certificate": await _refusal(etcd, EtcdAccess(
                ca=certs["node"].ca, cert=certs["rogue"].cert, key=certs["rogue"].key)),
            "server not under the CA": await _refusal(etcd, _access(certs["rogue"])),
        }
        assert "probably serves TLS: give --etcd-ca" in why["plaintext"]
        for name in ("no client certificate", "another CA's certificate"):
            assert "refused this process's client certificate: give --etcd-cert" in why[name]
        assert "must chain to --etcd-ca" in why["server not under the CA"]
        # a node without certificates keeps trying, and says why in its log
        with caplog.at_level(logging.WARNING, logger="cluster.discovery"):
            node = EtcdRegistry(etcd.endpoint, "tls", ttl=3, timeout=2)
            await node.register(NodeRecord("p1", "prefill", "127.0.0.1:2", "i2"))
            assert not await node.wait_registered(2)
            await node.close()
        assert any("give --etcd-ca" in r.getMessage() for r in caplog.records)
    asyncio.run(main())


def _etcdctl(etcd, certs, *args: str, user: str | None = None) -> None:
    ctl = Path(sys.executable).parent / "etcdctl"
    tls = certs["node"]
    cmd = [str(ctl), "--endpoints", etcd.client_url, "--cacert", tls.ca, "--cert", tls.cert,
           "--key", tls.key, *(["--user", user] if user else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def test_user_and_password_over_tls(certs, tmp_path):
    """etcd auth on (a fresh etcd: auth stays on): the right password registers, a wrong
    one is refused naming the flags. The password travels inside TLS only."""
    server = EtcdServer(tmp_path / "auth", tls=certs["etcd"]).start()
    try:
        _etcdctl(server, certs, "user", "add", "root:rootpw")
        _etcdctl(server, certs, "user", "add", "pd:pdpw")
        _etcdctl(server, certs, "role", "add", "pd")
        _etcdctl(server, certs, "role", "grant-permission", "pd", "--prefix=true",
                 "readwrite", "/pdserve/")
        _etcdctl(server, certs, "user", "grant-role", "pd", "pd")
        _etcdctl(server, certs, "auth", "enable", user="root:rootpw")

        async def main():
            good = _access(certs["node"], user="pd", password="pdpw")
            node = EtcdRegistry(server.endpoint, "auth", ttl=3, access=good)
            await node.register(NodeRecord("d1", "decode", "127.0.0.1:1", "i1"))
            assert await node.wait_registered(10)
            await node.close()
            bad = _access(certs["node"], user="pd", password="wrong")
            assert "refused the credentials" in await _refusal(server, bad)
            assert "--etcd-password" in await _refusal(server, bad)
        asyncio.run(main())
    finally:
        server.stop()


def test_access_options_are_checked(certs):
    tls = certs["node"]
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key together"):
        EtcdAccess(ca=tls.ca, cert=tls.cert)
    with pytest.raises(ValueError, match="both a user"):
        EtcdAccess(user="pd")
    with pytest.raises(ValueError, match="--etcd-ca /nope: no such file"):
        EtcdAccess(ca="/nope")
    assert "pdpw" not in repr(EtcdAccess(user="pd", password="pdpw"))
    assert not EtcdAccess().tls and EtcdAccess(ca=tls.ca).tls
    assert resolve_access("https://h:1", None).tls          # https:// turns TLS on
    with pytest.raises(ValueError, match="say http://"):
        resolve_access("http://h:1", EtcdAccess(ca=tls.ca))
    with pytest.raises(ValueError, match="mix"):
        resolve_access("http://h:1,https://h:2", None)


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_every_role_takes_the_same_etcd_flags(role, certs, monkeypatch):
    tls = certs["node"]
    monkeypatch.setenv("PDSERVE_ETCD_PASSWORD", "from-env")
    args = build_parser().parse_args([role, "--etcd-ca", tls.ca, "--etcd-cert", tls.cert,
                                      "--etcd-key", tls.key, "--etcd-user", "pd"])
    access = etcd_access_from_args(args)
    assert (access.ca, access.cert, access.key, access.user, access.password, access.tls) == (
        tls.ca, tls.cert, tls.key, "pd", "from-env", True)
    monkeypatch.delenv("PDSERVE_ETCD_PASSWORD")
    with pytest.raises(CliError, match="both a user"):
        etcd_access_from_args(build_parser().parse_args([role, "--etcd-user", "pd"]))


def test_pdserve_up_runs_etcd_with_client_tls(tmp_path):
    """LocalCluster (pdserve up) by default: etcd https-only with client-cert-auth, and
    every child gets --etcd-ca/--etcd-cert/--etcd-key of its own leaf; --insecure: none."""
    from launch.local_cluster import LocalCluster, LocalClusterConfig

    cluster = LocalCluster(LocalClusterConfig(model="unused", run_dir=tmp_path / "up"))
    assert cluster.etcd.tls is not None and cluster.etcd.client_url.startswith("https://")
    assert "--client-cert-auth" in cluster.etcd.tls_flags()
    flags = cluster.tls_flags("router")
    got = dict(zip(flags[::2], flags[1::2], strict=True))
    assert got["--etcd-cert"] == got["--tls-cert"] and got["--etcd-ca"] == got["--tls-ca"]
    cluster.etcd.start()
    try:
        async def main():
            access = EtcdAccess(ca=got["--etcd-ca"], cert=got["--etcd-cert"],
                                key=got["--etcd-key"])
            node = EtcdRegistry(cluster.etcd.endpoint, "up", ttl=3, access=access)
            await node.register(NodeRecord("d1", "decode", "127.0.0.1:1", "i1"))
            assert await node.wait_registered(10)
            await node.close()
        asyncio.run(main())
    finally:
        cluster.etcd.stop()
    plain = LocalCluster(LocalClusterConfig(model="unused", run_dir=tmp_path / "plain",
                                            tls=False))
    assert plain.etcd.tls is None and plain.tls_flags("router") == []
