"""The "internet" of scripts/test-e2b-clients.sh: run inside a network
namespace the script made, it answers DNS on IP:53 (the node's DNS
upstream) with IP for every name in NAMES (any other name: NXDOMAIN) and
serves ROOT over HTTP on IP:80 (the Debian archive of debmirror.sh), logging
each request line to LOG. Runs until killed.

    python3 fakenet.py IP ROOT LOG NAME...
"""

import functools
import http.server
import socket
import struct
import sys
import threading


def dns_answer(query: bytes, names: set, ip: str) -> bytes:
    tid, flags = query[:2], struct.unpack(">H", query[2:4])[0]
    i, labels = 12, []
    while query[i]:
        n = query[i]
        labels.append(query[i + 1 : i + 1 + n].decode("ascii", "replace").lower())
        i += 1 + n
    qtype = struct.unpack(">H", query[i + 1 : i + 3])[0]
    question = query[12 : i + 5]
    ours = ".".join(labels) in names
    answers = b""
    if ours and qtype == 1:
        answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + socket.inet_aton(ip)
    rcode = 0 if ours else 3
    hdr = struct.pack(">HHHHH", 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode, 1, 1 if answers else 0, 0, 0)
    return tid + hdr + question + answers


def serve_dns(ip: str, names: set):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, 53))
    while True:
        q, peer = s.recvfrom(512)
        try:
            s.sendto(dns_answer(q, names, ip), peer)
        except Exception:  # a malformed query gets no answer
            pass


def main():
    ip, root, log = sys.argv[1:4]
    names = {n.lower().strip(".") for n in sys.argv[4:]}
    logf = open(log, "a", buffering=1)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code="-", size="-"):
            logf.write(f"{self.command} {self.path} {int(code)}\n")

        def log_message(self, fmt, *args):
            pass

    threading.Thread(target=serve_dns, args=(ip, names), daemon=True).start()
    srv = http.server.ThreadingHTTPServer((ip, 80), functools.partial(Handler, directory=root))
    print("ready", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
