"""A stand-in for the services the example manifests call (payments, warehouse, shipping,
flights, credit bureau), for docker/compose.yaml: every POST succeeds with the fields the
example sagas read from their results. GET answers 200 too (the healthcheck).

    python3 upstream.py [PORT [ADDRESS]]    # default: port 80 on every interface
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        ref = self.headers.get("Idempotency-Key", "")[-6:]
        self.answer({
            "payment_id": "pay-" + ref,
            "reservation_id": "res-" + ref,
            "tracking_number": "trk-" + ref,
            "booking_ref": "REF-" + ref,
            "arrival": "2026-12-01T10:00:00Z",
            "score": 700,
        })

    def do_GET(self):
        self.answer({"status": "ok"})

    def log_message(self, fmt, *args):
        sys.stderr.write("upstream: %s %s\n" % (self.command, self.path))


port = int(sys.argv[1]) if len(sys.argv) > 1 else 80
address = sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0"
ThreadingHTTPServer((address, port), Handler).serve_forever()
