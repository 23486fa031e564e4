"""Starts `wasi-nn-host serve` for the Python tests and reads the HF fixtures.

The scripts/test-python.sh runner sets WASI_NN_HOST and GPT2_COMPONENT (the release binary and
the pre-initialised component); the servers listen on free loopback ports.
"""
import json
import os
import re
import signal
import struct
import subprocess
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = os.environ.get("WASI_NN_HOST", os.path.join(ROOT, "target/release/wasi-nn-host"))
COMPONENT = os.environ.get(
    "GPT2_COMPONENT", os.path.join(ROOT, "target/wasm32-wasip2/release-wasm/gpt2_component.preinit.wasm")
)
TEMPLATE = os.path.join(ROOT, "tests/python/chat_template.jinja")


class Server:
    """One `wasi-nn-host serve` process; its stderr is kept for the failure messages."""

    def __init__(self, *args):
        cmd = [HOST, "serve", "--component", COMPONENT, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.log = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))

    def get(self, path, key=None):
        request = urllib.request.Request(self.url + path)
        if key:
            request.add_header("Authorization", "Bearer " + key)
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.read().decode()

    def terminate(self):
        self.proc.send_signal(signal.SIGTERM)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def fixture():
    with open(os.path.join(ROOT, "tests/fixtures/shakespeare.json")) as f:
        data = json.load(f)
    with open(os.path.join(ROOT, "tests/fixtures/shakespeare_logits.bin"), "rb") as f:
        raw = f.read()
    vocab = 50257
    rows = [struct.unpack_from("<%df" % vocab, raw, 4 * vocab * i) for i in range(len(raw) // (4 * vocab))]
    return data, rows


def log_softmax(row):
    import math

    top = max(row)
    lse = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - lse for v in row]


def wait_for(predicate, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
