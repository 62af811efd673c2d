#!/usr/bin/env python3
"""Publish one event to NATS JetStream and wait for the stream's acknowledgement.

The user guide's stand-in for `nats pub` (the NATS command-line tool), using only the
Python standard library and the NATS text protocol:

    publish.py [--server nats://127.0.0.1:4222] SUBJECT EVENT.json [KEY=VALUE ...]

EVENT.json is the event envelope. KEY=VALUE pairs set string fields, a dotted key reaching
inside (`tenant_id=globex`, `payload.applicant_id=a-low-1`). `event_id` (a fresh UUID) and `timestamp_ms` (now) are
filled in when absent, as a producer would; the event id also goes out as the
`Nats-Msg-Id` header, so publishing the same file twice with the same id is de-duplicated
by JetStream. Prints the stream and sequence the event was stored at; exits 1 when no
stream took it.
"""
import json
import socket
import sys
import time
import uuid


def main(argv):
    server = "nats://127.0.0.1:4222"
    if len(argv) >= 2 and argv[0] == "--server":
        server, argv = argv[1], argv[2:]
    if len(argv) < 2:
        sys.exit(__doc__)
    subject, path, extra = argv[0], argv[1], argv[2:]
    with open(path, encoding="utf-8") as f:
        event = json.load(f)
    for pair in extra:
        key, _, value = pair.partition("=")
        *parents, last = key.split(".")
        target = event
        for name in parents:
            target = target.setdefault(name, {})
        target[last] = value
    event.setdefault("event_id", str(uuid.uuid4()))
    event.setdefault("timestamp_ms", int(time.time() * 1000))
    body = json.dumps(event).encode()
    headers = f"NATS/1.0\r\nNats-Msg-Id: {event['event_id']}\r\n\r\n".encode()

    host, _, port = server.removeprefix("nats://").partition(":")
    sock = socket.create_connection((host, int(port or 4222)), timeout=10)
    reader = sock.makefile("rb")
    reader.readline()  # INFO {...}
    inbox = "_INBOX." + uuid.uuid4().hex
    sock.sendall(
        b'CONNECT {"verbose":false,"headers":true,"no_responders":true,"lang":"python"}\r\n'
        + f"SUB {inbox} 1\r\n".encode()
        + f"HPUB {subject} {inbox} {len(headers)} {len(headers) + len(body)}\r\n".encode()
        + headers + body + b"\r\n"
    )
    while True:
        line = reader.readline()
        if not line:
            sys.exit("publish: the server closed the connection")
        op = line.split()[0].upper() if line.split() else b""
        if op == b"PING":
            sock.sendall(b"PONG\r\n")
        elif op == b"-ERR":
            sys.exit(f"publish: {line.decode().strip()}")
        elif op in (b"MSG", b"HMSG"):
            size = int(line.split()[-1])
            payload = reader.read(size + 2)[:size]
            if op == b"HMSG":
                head_len = int(line.split()[-2])
                status, payload = payload[:head_len], payload[head_len:]
                if b" 503" in status.split(b"\r\n")[0]:
                    sys.exit(f"publish: no stream takes subject {subject}")
            ack = json.loads(payload or b"{}")
            if "error" in ack:
                sys.exit(f"publish: {ack['error'].get('description', ack['error'])}")
            dup = " (duplicate)" if ack.get("duplicate") else ""
            print(f"published {subject} to {ack.get('stream')} seq {ack.get('seq')}{dup}")
            return


if __name__ == "__main__":
    main(sys.argv[1:])
