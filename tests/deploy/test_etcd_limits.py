"""Every bundled etcd compacts its history and has a space quota that fits its volume:
without both, discovery's writes grow the database until etcd refuses every write."""

from __future__ import annotations

import re

import pytest

from tests.deploy.conftest import RENDERED_NAMES
from tests.deploy.manifests import find

UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * UNITS[unit or ""]


@pytest.mark.parametrize("name", [n for n in RENDERED_NAMES if n != "external-etcd"])
def test_bundled_etcd_compacts_and_has_a_quota_under_its_volume(rendered, name):
    (etcd,) = find(rendered[name], "StatefulSet", "pdserve-etcd")
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.get("ETCD_AUTO_COMPACTION_MODE") in ("periodic", "revision"), env
    assert env.get("ETCD_AUTO_COMPACTION_RETENTION"), env
    quota = int(env["ETCD_QUOTA_BACKEND_BYTES"])
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    volume = _bytes(claim["spec"]["resources"]["requests"]["storage"])
    # the volume also holds the WAL and snapshots: the database gets at most half
    assert 0 < quota <= volume // 2, (quota, volume)


def test_external_etcd_setup_bundles_no_etcd(rendered):
    assert not find(rendered["external-etcd"], "StatefulSet", "pdserve-etcd")
