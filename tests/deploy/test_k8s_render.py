"""Every overlay renders with kubectl kustomize and every object passes kubernetes-validate in
strict mode (unknown fields rejected) against a current Kubernetes release, offline."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.conftest import EXTERNAL_ETCD, RENDERED_NAMES
from tests.deploy.manifests import (
    KUBERNETES_VERSION,
    OVERLAYS,
    RenderError,
    find,
    one,
    render,
)

EXPECTED_KINDS = {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment", "Job",
                  "PersistentVolumeClaim", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                  "NetworkPolicy"}


def test_validator_ships_the_version_we_check_against():
    # validate() silently falls back to an older schema set for a version it lacks.
    from kubernetes_validate.utils import all_versions

    assert KUBERNETES_VERSION in all_versions()


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_renders_and_validates_strict(rendered, name):
    objects = rendered[name]
    kinds = {o["kind"] for o in objects}
    expected = EXPECTED_KINDS - ({"StatefulSet"} if name == "external-etcd" else set())
    assert expected <= kinds, f"{name} lacks {expected - kinds}"
    for obj in objects:
        version = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert version == ".".join(KUBERNETES_VERSION.split(".")[:2])
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "pdserve", obj["metadata"]["name"]


def test_strict_validation_rejects_an_unknown_field(rendered):
    deployment = copy.deepcopy(one(rendered["cpu-dev"], "Deployment", "pdserve-decode"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcPort"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="grpcPort"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_validation_rejects_a_wrong_type(rendered):
    hpa = copy.deepcopy(one(rendered["base"], "HorizontalPodAutoscaler", "pdserve-prefill"))
    hpa["spec"]["minReplicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_render_reports_a_broken_kustomization(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(RenderError, match="missing.yaml"):
        render(tmp_path)


def _container(objects, deployment):
    return one(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay,resource", [("cuda", "nvidia.com/gpu"),
                                              ("ascend", "huawei.com/Ascend910")])
def test_accelerator_overlays_request_one_device_per_node_pod(rendered, overlay, resource):
    for role in ("prefill", "decode"):
        limits = _container(rendered[overlay], f"pdserve-{role}")["resources"]["limits"]
        assert limits[resource] == 1
    router = _container(rendered[overlay], "pdserve-router")["resources"]
    assert resource not in router.get("limits", {}), "the router needs no accelerator"


def test_ascend_mounts_what_torch_npu_opens(rendered):
    spec = one(rendered["ascend"], "Deployment", "pdserve-decode")["spec"]["template"]["spec"]
    host_paths = {v["hostPath"]["path"]: v["hostPath"].get("type")
                  for v in spec["volumes"] if "hostPath" in v}
    for device in ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"):
        assert host_paths.get(device) == "CharDevice"
    assert host_paths["/usr/local/Ascend/driver"] == "Directory"
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/usr/local/Ascend/driver"]["readOnly"] is True
    assert set(host_paths) <= set(mounts)


def test_cpu_dev_is_small_with_one_etcd(rendered):
    objects = rendered["cpu-dev"]
    assert one(objects, "StatefulSet", "pdserve-etcd")["spec"]["replicas"] == 1
    assert one(objects, "PersistentVolumeClaim", "pdserve-model")["spec"]["accessModes"] == [
        "ReadWriteOnce"]
    for hpa in find(objects, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["maxReplicas"] <= 2


def test_external_etcd_drops_the_bundled_one(rendered):
    objects = rendered["external-etcd"]
    assert not find(objects, "StatefulSet")
    assert not [o for o in objects if "etcd" in o["metadata"]["name"]]
    cluster = [o for o in find(objects, "ConfigMap")
               if o["metadata"]["name"].startswith("pdserve-cluster")]
    assert cluster[0]["data"]["PDSERVE_ETCD"] == EXTERNAL_ETCD


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_pins_its_image_variant(rendered, overlay):
    images = {c["image"] for o in rendered[overlay] if o["kind"] in ("Deployment", "Job")
              for c in (o["spec"]["template"]["spec"]["containers"]
                        + o["spec"]["template"]["spec"].get("initContainers", []))}
    tag = {"cpu-dev": "cpu"}.get(overlay, overlay)
    assert images == {f"pdserve:{tag}"}


def test_cluster_tls_mounts_the_secret_and_probes_with_the_node_certificate(rendered):
    objects = rendered["cluster-tls"]
    for role in ("router", "prefill", "decode"):
        pod = one(objects, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "pdserve-tls"
        assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"][
            "fsGroup"] == pod["securityContext"]["runAsGroup"]
        (c,) = [c for c in pod["containers"] if c["name"] == role]
        assert {"name": "tls", "mountPath": "/etc/pdserve/tls", "readOnly": True} in \
            c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PDSERVE_TLS_CA"] == "/etc/pdserve/tls/ca.crt"
        assert env["PDSERVE_TLS_CERT"] == f"/etc/pdserve/tls/{role}.crt"
        assert env["PDSERVE_TLS_KEY"] == f"/etc/pdserve/tls/{role}.key"
        # the same leaf dials etcd, which requires a client certificate of the CA
        assert (env["PDSERVE_ETCD_CA"], env["PDSERVE_ETCD_CERT"], env["PDSERVE_ETCD_KEY"]) == (
            env["PDSERVE_TLS_CA"], env["PDSERVE_TLS_CERT"], env["PDSERVE_TLS_KEY"])
        if role != "router":        # a kubelet grpc probe cannot show a client certificate
            for probe in ("startupProbe", "readinessProbe"):
                assert "grpc" not in c[probe], (role, probe)
                assert c[probe]["exec"]["command"] == ["python", "-m", "launch.healthcheck"]


def test_cluster_tls_serves_etcd_over_https_with_client_certificates(rendered):
    objects = rendered["cluster-tls"]
    pod = one(objects, "StatefulSet", "pdserve-etcd")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ETCD_LISTEN_CLIENT_URLS"] == "https://0.0.0.0:2379"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"].startswith("https://")
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true"
    assert (env["ETCD_CERT_FILE"], env["ETCD_KEY_FILE"], env["ETCD_TRUSTED_CA_FILE"]) == (
        "/etc/pdserve/tls/etcd.crt", "/etc/pdserve/tls/etcd.key", "/etc/pdserve/tls/ca.crt")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"] == {"secretName": "pdserve-tls", "defaultMode": 0o440}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # the kubelet's probe shows no certificate: /health on the plaintext metrics listener
    metrics = env["ETCD_LISTEN_METRICS_URLS"].rpartition(":")[2]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {"name": "metrics", "containerPort": int(metrics)} in c["ports"]
