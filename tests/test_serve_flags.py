"""The server flags vLLM users pass out of habit, on a real `loraserve serve`:
HTTPS, CORS, a proxy's root path, request logging, the response role, no access
log, vLLM's flags for what loraserve does anyway, and prefix caching seen
through /v1/engine_stats. One server start-up for all of them."""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import START_TIMEOUT_S, ServerProcess, descendants

API_KEY = "flags-key"
ORIGIN = "https://app.example"


def _self_signed_cert(folder: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made with `cryptography` or openssl."""
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(key_path), "-out", str(cert_path), "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )
        return str(key_path), str(cert_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


class HTTPSServer(ServerProcess):
    """A server started with --ssl-keyfile/--ssl-certfile: spoken to over HTTPS,
    trusting only its own certificate."""

    cert_path: str = ""

    def _wait_healthy(self) -> None:
        self.url = self.url.replace("http://", "https://")
        self.verify = ssl.create_default_context(cafile=self.cert_path)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2,
                             verify=self.verify).status_code == 200:
                    self._all_pids = {self.proc.pid, *descendants(self.proc.pid)}
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, self.url + path, verify=self.verify, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    key, cert = _self_signed_cert(tmp_path_factory.mktemp("tls"))
    HTTPSServer.cert_path = cert
    with HTTPSServer([llama_dir, "--device", "cpu", "--max-num-seqs", "4", "--block-size", "4",
                      "--ssl-keyfile", key, "--ssl-certfile", cert,
                      "--root-path", "/proxied", "--allowed-origins", f'["{ORIGIN}"]',
                      "--enable-log-requests", "--trust-remote-code",
                      "--enable-prefix-caching", "--response-role", "narrator",
                      "--disable-uvicorn-access-log", "--disable-log-stats",
                      "--enable-chunked-prefill", "--swap-space", "4", "--max-log-len", "10",
                      "--kv-cache-dtype", "auto", "-pp", "1", "-dp", "1"],
                     api_key=API_KEY, uvicorn_log_level="info") as proc:
        yield proc


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_https_serves_and_plain_http_does_not(server):
    assert server.request("GET", "/v1/models", headers=_auth()).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)


def test_cors_preflight_gets_the_headers_without_an_api_key(server):
    response = server.request("OPTIONS", "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    # An origin that is not allowed gets no CORS grant.
    other = server.request("OPTIONS", "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    # A refused request still carries the header, so the browser shows the 401.
    refused = server.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN


def test_root_path_is_what_the_api_says_it_is_served_under(server):
    spec = server.request("GET", "/openapi.json", headers=_auth())
    assert spec.status_code == 200
    assert spec.json()["servers"] == [{"url": "/proxied"}]
    docs = server.request("GET", "/docs", headers=_auth())
    assert "/proxied/openapi.json" in docs.text


def test_requests_are_logged_and_a_repeated_prompt_hits_the_prefix_cache(server, llama_dir):
    prompt = "Once upon a time there was a tiny model that learned to count to ten"
    body = {"model": llama_dir, "prompt": prompt, "max_tokens": 3,
            "temperature": 0.0, "ignore_eos": True}
    texts = []
    for _ in range(2):
        response = server.request("POST", "/v1/completions", headers=_auth(), json=body)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    stats = server.request("GET", "/v1/engine_stats", headers=_auth()).json()["scheduler"]
    queried, hit = stats["prefix_cache_tokens"]
    assert queried > 0 and hit >= 4  # the second request reused at least a block
    # vLLM's prefix cache counters, in tokens, agree with the engine's totals.
    metrics = server.request("GET", "/metrics", headers=_auth()).text
    totals = {s.name: s.value for f in text_string_to_metric_families(metrics)
              for s in f.samples if s.name.startswith("loraserve:prefix_cache_")
              and s.name.endswith("_total")}
    assert totals == {"loraserve:prefix_cache_queries_total": queried,
                      "loraserve:prefix_cache_hits_total": hit}
    log = server.output()
    assert "prompt tokens, sampling:" in log and "temperature=0.0" in log
    assert "max_tokens=3" in log and prompt not in log


def test_response_role_names_the_answer_and_no_request_is_access_logged(server, llama_dir):
    chat = {"model": llama_dir, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2}
    full = server.request("POST", "/v1/chat/completions", headers=_auth(), json=chat)
    assert full.status_code == 200, full.text
    assert full.json()["choices"][0]["message"]["role"] == "narrator"
    streamed = server.request("POST", "/v1/chat/completions", headers=_auth(),
                              json={**chat, "stream": True})
    first = next(line for line in streamed.text.splitlines() if line.startswith("data: {"))
    assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "narrator"
    # Without a generation prompt the answer continues the last message, in its role.
    go_on = {**chat, "add_generation_prompt": False, "continue_final_message": True,
             "messages": [*chat["messages"], {"role": "assistant", "content": "Hello"}]}
    continued = server.request("POST", "/v1/chat/completions", headers=_auth(), json=go_on)
    assert continued.status_code == 200, continued.text
    assert continued.json()["choices"][0]["message"]["role"] == "assistant"
    log = server.output()
    assert "Application startup complete" in log  # uvicorn logs at info level here
    assert "POST /v1/chat/completions" not in log
