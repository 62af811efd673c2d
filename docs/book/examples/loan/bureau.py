#!/usr/bin/env python3
"""A stand-in credit bureau for the user guide's loan saga.

    bureau.py PORT        # serves POST /v1/scores on 127.0.0.1:PORT

Answers `{"score": N}`: 540 for applicants whose id starts with `a-low`, else 712. An
applicant id starting with `a-slow` is answered after 1.5 s (inside the effect's 2 s
timeout), which leaves time for a withdrawal to overtake the answer; one starting with
`a-wait` after 5 s, so every attempt times out. Requires
`Authorization: Bearer $BUREAU_TOKEN` (401 otherwise, which the http provider reports as a
fatal `Failed`). Prints one line per call with the Idempotency-Key Runner sent.
"""
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = os.environ.get("BUREAU_TOKEN", "")


class Bureau(BaseHTTPRequestHandler):
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        applicant = str(request.get("applicant", ""))
        print(f"bureau: {self.path} applicant={applicant} key={self.headers.get('Idempotency-Key')}",
              flush=True)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.answer(401, {"error": "bad token"})
        if self.path != "/v1/scores":
            return self.answer(404, {"error": "no such path"})
        if applicant.startswith("a-slow"):
            time.sleep(1.5)
        if applicant.startswith("a-wait"):
            time.sleep(5)
        return self.answer(200, {"score": 540 if applicant.startswith("a-low") else 712})

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Bureau).serve_forever()
