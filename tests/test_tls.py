"""TLS on the Coordinator's own ports: each port its own setting (`infer_tls_config` for inference,
`mgmt_tls_config` for management and metrics), and `ca_file` checking the client certificates presented."""

from __future__ import annotations

import ssl

import httpx
import pytest

from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from tests.certs import Certs, make_certs
from tests.conftest import MODEL


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("coordinator-tls"))


def plain(url: str) -> int:
    return httpx.get(url, timeout=5).status_code


def tls(url: str, certs: Certs, client: tuple[str, str] | None = None) -> int:
    context = ssl.create_default_context(cafile=certs.ca)
    if client:
        context.load_cert_chain(*client)
    return httpx.get(url, timeout=5, verify=context).status_code


def refused(call) -> bool:
    try:
        call()
    except (httpx.TransportError, ssl.SSLError):
        return True
    return False


def test_management_tls_covers_management_and_metrics_only(sims, certs):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        mgmt_tls_config={"enable_tls": True, "cert_file": certs.cert, "key_file": certs.key},
    )
    with Coordinator(cfg, verify=certs.ca) as coord:
        assert coord.mgmt.startswith("https://") and coord.url.startswith("http://")
        assert tls(coord.mgmt + "/readiness", certs) == 200 and tls(coord.obs + "/metrics", certs) == 200
        for port in (coord.mgmt_port, coord.obs_port):
            assert refused(
                lambda port=port: plain(f"http://127.0.0.1:{port}/readiness")
            )  # no plain HTTP where TLS is on
        assert plain(coord.url + "/v1/models") == 200  # the inference port keeps its own setting: plain HTTP


def test_inference_tls_with_a_ca_checks_the_client_certificates_presented(sims, certs):
    """`ca_file`: a client certificate must be one it signed; a client with none (a probe, Prometheus, an
    engine calling /v1/metaserver) is still served."""
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        infer_tls_config={"enable_tls": True, "cert_file": certs.cert, "key_file": certs.key, "ca_file": certs.ca},
    )
    with Coordinator(cfg) as coord:
        assert coord.url.startswith("https://")
        assert tls(coord.url + "/v1/models", certs, (certs.client_cert, certs.client_key)) == 200
        assert tls(coord.url + "/v1/models", certs) == 200
        stranger = (certs.other_ca, certs.other_ca[: -len(".pem")] + ".key")  # a certificate the CA did not sign
        assert refused(lambda: tls(coord.url + "/v1/models", certs, stranger))
        assert refused(lambda: plain(f"http://127.0.0.1:{coord.infer_port}/v1/models"))
        assert (
            plain(coord.mgmt + "/readiness") == 200 and plain(coord.obs + "/metrics") == 200
        )  # plain: their own setting
