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

    ok            200, a whole answer (a stream to its [DONE], no error
                  event in it)
    budgeted-503  503 with a Retry-After header (the service said when)
    refused       the connection was refused
    http-NNN      any other status
    stream-error  200, a stream that ended with an error event (vLLM's, or
                  the front door's when the engine went away mid-stream)
    error-KIND    anything else (reset, a stream cut short, a timeout)

OUT gets one JSON object: the counts, the longest wait for an answer, how
many waited longer than 2 s (held while the engine was not serving), and
each outcome but ok and budgeted-503 with the wall-clock time it ended at.

    load.py judge OUT WINDOWS [BUDGET]

reads OUT and a file of windows (one "START END" per line, wall-clock
seconds: from an EngineCore's SIGKILL to the model served again) and
exits 0 when every answer was ok or budgeted-503, except streams that
ended with an error event inside a window (a stream begun before its
engine was killed cannot be finished by anyone, only ended in words the
client reads) and at most BUDGET (a fraction of the requests, default 0)
other answers. It prints what it counted, with the wall-clock time of
each other answer.
"""

import http.client
import json
import os
import sys
import threading
import time
import urllib.parse


def judge(out, windows, budget=0.0):
    with open(out) as f:
        result = json.load(f)
    spans = []
    with open(windows) as f:
        for line in f:
            if line.strip():
                a, b = line.split()
                spans.append((float(a), float(b)))
    inside = [o for t, o in result["others"] if o == "stream-error" and any(a <= t <= b for a, b in spans)]
    wrong = [(t, o) for t, o in result["others"] if not (o == "stream-error" and any(a <= t <= b for a, b in spans))]
    print("#   streams ended with an error event while an engine was killed: %d" % len(inside))
    if wrong:
        print("#   other answers (wall-clock time, outcome):", wrong)
    allowed = int(budget * result["requests"])
    print("#   other answers: %d of %d requests (at most %d allowed)" % (len(wrong), result["requests"], allowed))
    return 0 if result["counts"].get("ok", 0) > 0 and len(wrong) <= allowed else 1


if sys.argv[1] == "judge":
    sys.exit(judge(sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else 0.0))

url, model, stopfile, out = sys.argv[1:5]
clients = int(sys.argv[5]) if len(sys.argv) > 5 else 4
target = urllib.parse.urlsplit(url)
lock = threading.Lock()
counts = {}
waits = []
others = []


def count(outcome, waited):
    with lock:
        counts[outcome] = counts.get(outcome, 0) + 1
        waits.append(waited)
        if outcome not in ("ok", "budgeted-503"):
            others.append((round(time.time(), 3), outcome))


def events(data):
    """The JSON of each `data:` event of a stream but [DONE]."""
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            try:
                yield json.loads(line[6:])
            except ValueError:
                yield {"error": "not JSON: %r" % line[:80]}


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
            if any("error" in e for e in events(data)):
                return "stream-error"
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
            "others": others,
        },
        f,
    )
os.rename(out + ".tmp", out)
