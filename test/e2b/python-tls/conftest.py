"""The E2B SDK over TLS and HTTP/2, with E2B's own endpoint resolution.

scripts/test-e2b-tls.sh starts a system whose gateway serves TLS (a
certificate from OpenDsec's CA, trusted through SSL_CERT_FILE) on
E2B_TEST_GATEWAY_IP:443 and runs this suite with neither E2B_API_URL nor
E2B_SANDBOX_URL set: the SDK calls https://api.<domain> and
https://49983-<id>.<domain>, as against E2B. Those names resolve through the
DNS server below, which the test runs on E2B_TEST_GATEWAY_IP:53 and which the
script makes the test process's only nameserver (a private mount namespace
with its own /etc/resolv.conf; the machine's is untouched). The SDK's HTTP
client (pyqwest) resolves in Rust, so patching socket.getaddrinfo would not
reach it.
"""

import os
import socket
import struct
import threading

import pytest

for var in ("E2B_API_URL", "E2B_SANDBOX_URL"):
    if os.environ.get(var):
        raise RuntimeError(f"{var} is set; this suite tests the SDK's own https://<host> resolution")
for var in ("E2B_DOMAIN", "E2B_API_KEY", "E2B_TEST_GATEWAY_IP", "SSL_CERT_FILE"):
    if not os.environ.get(var):
        raise RuntimeError(f"{var} is not set; run scripts/test-e2b-tls.sh")

DOMAIN = os.environ["E2B_DOMAIN"].lower().strip(".")
GATEWAY_IP = os.environ["E2B_TEST_GATEWAY_IP"]


def dns_answer(query: bytes, domain: str, ip: str) -> bytes:
    """An answer to one DNS query: <domain> and every name under it are ip
    (A; no AAAA); any other name is refused."""
    tid, flags = query[:2], struct.unpack(">H", query[2:4])[0]
    i, labels = 12, []
    while query[i]:
        n = query[i]
        labels.append(query[i + 1 : i + 1 + n].decode("ascii", "replace").lower())
        i += 1 + n
    qtype = struct.unpack(">H", query[i + 1 : i + 3])[0]
    question = query[12 : i + 5]
    name = ".".join(labels)
    ours = name == domain or name.endswith("." + domain)
    rcode = 0 if ours else 5
    answers = b""
    if ours and qtype == 1:
        answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton(ip)
    hdr = struct.pack(
        ">HHHHH",
        0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode,
        1,
        1 if answers else 0,
        0,
        0,
    )
    return tid + hdr + question + answers


@pytest.fixture(scope="session", autouse=True)
def resolver():
    """Serves DNS for the domain on GATEWAY_IP:53 for the whole session."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((GATEWAY_IP, 53))
    stop = threading.Event()
    queries = []

    def serve():
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                q, peer = s.recvfrom(512)
            except socket.timeout:
                continue
            try:
                s.sendto(dns_answer(q, DOMAIN, GATEWAY_IP), peer)
                queries.append(q)
            except Exception:  # a malformed query gets no answer
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield queries
    stop.set()
    t.join()
    s.close()
