"""A constant, bounded load of completions against a model's address, as
clients meet it, while the end-to-end test restarts, reloads and upgrades
what serves it. Standard library only (it runs with the venv's Python
inside the container).

    load.py URL MODEL STOPFILE OUT [CLIENTS]

CLIENTS threads (default 4) each send one completion after another until
STOPFILE exists; every third is streamed (SSE, read to `data: [DONE]`). Each
request opens a connection of its own, so that a refused connection is seen
as such (a kept-alive connection closed under a client is another matter,
which HTTP leaves to the client). Each outcome is counted:

    ok            200, a whole answer (a stream to its [DONE])
    budgeted-503  503 with a Retry-After header (the service said when)
    refused       the connection was refused
    http-NNN      any other status
    error-KIND    anything else (reset, a stream cut short, a timeout)

OUT gets one JSON object: the counts, the longest wait for an answer, and
how many waited longer than 2 s (held while the engine was not serving).
"""

import http.client
import json
import os
import sys
import threading
import time
import urllib.parse

url, model, stopfile, out = sys.argv[1:5]
clients = int(sys.argv[5]) if len(sys.argv) > 5 else 4
target = urllib.parse.urlsplit(url)
lock = threading.Lock()
counts = {}
waits = []


def count(outcome, waited):
    with lock:
        counts[outcome] = counts.get(outcome, 0) + 1
        waits.append(waited)


def one(stream):
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "stream": stream}
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=900)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json", "connection": "close"},
        )
        r = conn.getresponse()
        data = r.read()
        if r.status == 503 and r.getheader("retry-after"):
            return "budgeted-503"
        if r.status != 200:
            return "http-%d" % r.status
        if stream:
            return "ok" if b"data: [DONE]" in data else "error-stream-cut"
        return "ok" if b'"text"' in data else "error-no-text"
    except ConnectionRefusedError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - every other failure is counted by kind
        return "error-" + type(e).__name__
    finally:
        conn.close()


def client(n):
    i = n
    while not os.path.exists(stopfile):
        t = time.monotonic()
        outcome = one(stream=(i % 3 == 0))
        count(outcome, time.monotonic() - t)
        i += 1
        if outcome == "refused":
            # Not a busy loop while nothing listens; the count says it.
            time.sleep(0.1)


threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with open(out + ".tmp", "w") as f:
    json.dump(
        {
            "counts": counts,
            "requests": sum(counts.values()),
            "longest_wait_s": round(max(waits, default=0.0), 1),
            "waited_over_2s": sum(1 for w in waits if w > 2),
        },
        f,
    )
os.rename(out + ".tmp", out)
