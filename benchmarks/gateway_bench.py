"""The gateway under load (issue 11): N concurrent streaming requests through roles/llm_gateway's HAProxy
configuration to two llama-server services, and the same requests straight to the services.

Everything runs on loopback: two generated tiny models on the cached CPU llama-server, HAProxy from Debian 12's
packages (lab/haproxy.py) with the configuration rendered from the role's template. Bounded: N is 1..32, each
level sends --rounds rounds of --requests requests (at most 5 x 512) each way, and no level starts after
--deadline seconds.

For each N it prints: requests answered (200), refused with a status (counted by status), lost (no status:
a connection error or a cut stream; must be 0); p50/p95 of the time to the last byte through the gateway and
directly; the gateway's added latency as the median of the per-request differences (request i of a round
through the gateway minus the same request i of the same round sent directly; the target is under 5 ms at
p50); and HAProxy's resident memory (master and worker) after the level. Rounds alternate direct and gateway
so both see the same load; on a small machine the client, HAProxy and the servers share the cores, so at high N
the difference also holds HAProxy's share of the CPU.

    .venv/bin/python benchmarks/gateway_bench.py --concurrency 1 8 32 --requests 128

Slow clients (issue 19): with --slow-clients N..., N clients without a key each open a connection, send the
headers of a request announcing a body and only the start of that body, and hold the connection; meanwhile
--requests keyed streaming requests (--slow-concurrency at once, each given up after --slow-timeout seconds) go
through the gateway, and the same requests go without the slow clients. It prints how many slow connections the
gateway still held a second after they opened (the rest were answered, or closed as they arrived) and the keyed
requests' p50/p95 time to the last byte, a lost request counted at the time it was given up. The slow clients
come from 127.0.0.2, the keyed requests from 127.0.0.1: one attacking address and one client, the gateway
limiting connections per address. --slow-kind headers sends only part of the headers instead. --template
renders another version of the role's template (an earlier one, for a before/after):

    .venv/bin/python benchmarks/gateway_bench.py --concurrency --slow-clients 1100 --requests 64
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab import engine_build, haproxy, tinymodels  # noqa: E402
from lab.llama_server import serve  # noqa: E402
from lab.target import free_port  # noqa: E402

MODELS = ("bench-a", "bench-b")
PATHS = ("/v1/chat/completions", "/v1/messages")


def _request(port: int, path: str, body: bytes, key: str, timeout: float) -> tuple[int | None, float, str]:
    """One streaming request; (status or None if lost, seconds to the last byte, error)."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"})
        response = connection.getresponse()
        data = response.read()
        if response.status == 200 and not (b"[DONE]" in data or b"message_stop" in data):
            return None, time.perf_counter() - started, "stream ended early"
        return response.status, time.perf_counter() - started, ""
    except (OSError, http.client.HTTPException) as exc:
        return None, time.perf_counter() - started, type(exc).__name__
    finally:
        connection.close()


def _bodies(count: int, max_tokens: int) -> list[tuple[str, bytes]]:
    out = []
    for i in range(count):
        body = {"model": MODELS[i % 2], "max_tokens": max_tokens, "stream": True, "temperature": 0, "seed": i,
                "messages": [{"role": "user", "content": f"request {i}: tell me something"}]}
        out.append((PATHS[(i // 2) % 2], json.dumps(body).encode()))
    return out


def _run(ports: dict[str, int], bodies: list[tuple[str, bytes]], key: str, workers: int, timeout: float,
         ) -> list[tuple[int | None, float, str]]:
    """Send every body to its model's port; ``ports`` maps a model to a port (one port: the gateway)."""
    def one(item: tuple[str, bytes]) -> tuple[int | None, float, str]:
        path, body = item
        return _request(ports[json.loads(body)["model"]], path, body, key, timeout)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, bodies))


SLOW_SOURCE = "127.0.0.2"
# A request whose client stalls: the headers announce a body of which only the start (no model yet) is sent.
_SLOW_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
_SLOW = {"body": _SLOW_HEADERS + b"content-length: 4096\r\n\r\n{\"messages\": [", "headers": _SLOW_HEADERS}


def _slow_states(sockets: list[socket.socket]) -> dict[str, int]:
    """How each slow connection stands: held (no answer, still open), answered with a status, or closed."""
    states: dict[str, int] = {}
    for sock in sockets:
        sock.setblocking(False)
        try:
            head = sock.recv(12, socket.MSG_PEEK)
            state = head[9:12].decode() if head.startswith(b"HTTP/1.") else "closed"
        except BlockingIOError:
            state = "held"
        except OSError:
            state = "closed"
        states[state] = states.get(state, 0) + 1
    return states


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _haproxy_pids(master: int) -> list[int]:
    children = Path(f"/proc/{master}/task/{master}/children")
    return [master, *map(int, children.read_text().split())] if children.exists() else [master]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32],
                        help="levels of concurrent requests (1..32); none: only the slow cases")
    parser.add_argument("--requests", type=int, default=64, help="requests per level (at most 512)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=4, help="slots of each llama-server")
    parser.add_argument("--deadline", type=float, default=600.0, help="stop starting levels after this many seconds")
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/gateway rounds per level (1..5)")
    parser.add_argument("--slow-clients", type=int, nargs="*", default=[],
                        help="keyless slow clients held open during the keyed requests of each slow case (1..4000)")
    parser.add_argument("--slow-kind", choices=sorted(_SLOW), default="body",
                        help="what a slow client sends: the headers and the start of the body, or part of the headers")
    parser.add_argument("--slow-concurrency", type=int, default=4, help="keyed requests at once in the slow cases")
    parser.add_argument("--slow-timeout", type=float, default=10.0, help="a keyed request is lost after this long")
    parser.add_argument("--template", type=Path, help="render this haproxy.cfg.j2 instead of the role's")
    args = parser.parse_args()
    if not all(1 <= n <= 32 for n in args.concurrency) or not 1 <= args.requests <= 512 or not 1 <= args.rounds <= 5:
        parser.error("--concurrency takes values 1..32, --requests 1..512 and --rounds 1..5")
    if not all(1 <= n <= 4000 for n in args.slow_clients) or not 1 <= args.slow_concurrency <= 32:
        parser.error("--slow-clients takes values 1..4000 and --slow-concurrency 1..32")
    began = time.monotonic()
    key, server_key = secrets.token_hex(16), secrets.token_hex(16)
    server = engine_build.build() / "llama-server"
    binary, env = haproxy.unpacked()
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        key_file = folder / "server.key"
        key_file.write_text(server_key)
        running = {}
        for seed, model in enumerate(MODELS):
            path = tinymodels.write_model(folder / f"{model}.gguf", "llama", file_type="q8_0", name=model, seed=seed)
            running[model] = stack.enter_context(serve(server, path, [
                "--alias", model, "--jinja", "-c", str(2048 * args.parallel), "-np", str(args.parallel),
                "--api-key-file", str(key_file)], threads=1))
        port, metrics = free_port(), free_port()
        routes = [{"model": model, "box": "bench", "service": f"llama-{model}", "host": "127.0.0.1",
                   "port": running[model].port, "local": True} for model in MODELS]
        config = haproxy.render_config(folder / "gateway", {
            "llm_gateway_routes": routes, "llm_gateway_port": port, "llm_gateway_metrics_port": metrics},
            args.template)
        credentials = folder / "credentials"
        credentials.mkdir(mode=0o700)
        (credentials / "api-key").write_text(key + "\n")
        (credentials / "server-keys.map").write_text("".join(f"route_{i} {server_key}\n" for i in (1, 2)))
        gateway = subprocess.Popen([str(binary), "-Ws", "-f", str(config)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env={**env, "CREDENTIALS_DIRECTORY": str(credentials)})
        stack.callback(gateway.wait, 10)
        stack.callback(gateway.terminate)
        deadline = time.monotonic() + 20
        while _request(port, PATHS[0], _bodies(1, 1)[0][1], key, 5)[0] != 200:
            if time.monotonic() > deadline or gateway.poll() is not None:
                print("the gateway did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
        version = subprocess.run([str(binary), "-v"], check=False, capture_output=True, text=True, env=env).stdout.split("\n")[0]
        print(f"{version}; two llama-server services ({args.parallel} slots each); per level {args.rounds} rounds "
              f"of {args.requests} streaming requests ({args.max_tokens} tokens, both APIs) directly, then through "
              f"the gateway")
        print(f"idle gateway RSS: {_rss_kib(_haproxy_pids(gateway.pid)) / 1024:.1f} MiB")
        if args.concurrency:
            print(f"{'N':>3} {'ok':>4} {'refused':>8} {'lost':>5} {'gw p50':>8} {'gw p95':>8} {'direct p50':>10} "
                  f"{'direct p95':>10} {'added p50':>10} {'added p95':>10} {'gw RSS':>8}")
        direct_ports = {model: running[model].port for model in MODELS}
        gateway_ports = dict.fromkeys(MODELS, port)
        lost_total = 0
        for workers in args.concurrency:
            if time.monotonic() - began > args.deadline:
                print(f"deadline of {args.deadline:.0f} s reached; levels left out: N >= {workers}")
                break
            bodies = _bodies(args.requests, args.max_tokens)
            _run(direct_ports, bodies[:workers], server_key, workers, 120)  # warm the slots' caches
            direct, through = [], []
            for _round in range(args.rounds):  # alternate, so both see the same load on the machine
                direct += _run(direct_ports, bodies, server_key, workers, 120)
                through += _run(gateway_ports, bodies, key, workers, 120)
            rss = _rss_kib(_haproxy_pids(gateway.pid)) / 1024
            ok = [t for s, t, _ in through if s == 200]
            refused: dict[int, int] = {}
            for status, _t, _e in through:
                if status not in (None, 200):
                    refused[status] = refused.get(status, 0) + 1
            lost = [error for status, _t, error in through if status is None]
            lost_total += len(lost)
            straight = [t for s, t, _ in direct if s == 200]
            added = [(g[1] - d[1]) * 1000 for g, d in zip(through, direct) if g[0] == 200 and d[0] == 200]
            print(f"{workers:>3} {len(ok):>4} {json.dumps(refused) if refused else '0':>8} {len(lost):>5} "
                  f"{statistics.median(ok) * 1000:>6.1f}ms {_percentile(ok, 0.95) * 1000:>6.1f}ms "
                  f"{statistics.median(straight) * 1000:>8.1f}ms {_percentile(straight, 0.95) * 1000:>8.1f}ms "
                  f"{statistics.median(added):>8.2f}ms {_percentile(added, 0.95):>8.2f}ms {rss:>6.1f}MiB"
                  + (f"  lost: {sorted(set(lost))}" if lost else ""))
        if args.slow_clients:
            lost_total += _slow_cases(args, port, key, gateway.pid)
        print(f"total wall time {time.monotonic() - began:.0f} s; requests lost: {lost_total}")
    return 1 if lost_total else 0


def _slow_cases(args: argparse.Namespace, port: int, key: str, master: int) -> int:
    """Keyed requests through the gateway alone, then while each number of slow clients holds its connections."""
    sends = {"body": "the headers and the start of a 4096-byte body", "headers": "part of the headers"}
    print(f"slow clients from {SLOW_SOURCE}, no key, each sends {sends[args.slow_kind]} and holds; "
          f"{args.requests} keyed requests from 127.0.0.1, {args.slow_concurrency} at once, lost after "
          f"{args.slow_timeout:.0f} s; times to the last byte, a lost request counted at the time it was given up")
    print(f"{'slow':>5} {'held':>5} {'slow answered':>24} {'ok':>4} {'lost':>5} {'p50':>9} {'p95':>9} "
          f"{'alone p50':>10} {'alone p95':>10} {'gw RSS':>8}")
    bodies = _bodies(args.requests, args.max_tokens)
    gateway_ports = dict.fromkeys(MODELS, port)
    lost_total = 0
    for count in args.slow_clients:
        alone = _run(gateway_ports, bodies, key, args.slow_concurrency, args.slow_timeout)
        sockets = haproxy.stalled_clients(port, count, SLOW_SOURCE, _SLOW[args.slow_kind], timeout=2)
        try:
            time.sleep(1)
            states = _slow_states(sockets)
            if count > len(sockets):  # closed while opening
                states["closed"] = states.get("closed", 0) + count - len(sockets)
            held = states.pop("held", 0)
            loaded = _run(gateway_ports, bodies, key, args.slow_concurrency, args.slow_timeout)
            rss = _rss_kib(_haproxy_pids(master)) / 1024
        finally:
            for sock in sockets:
                sock.close()
        lost = [error for status, _t, error in loaded if status is None]
        lost_total += len(lost)
        times, alone_times = [t for _s, t, _e in loaded], [t for _s, t, _e in alone]
        print(f"{count:>5} {held:>5} {json.dumps(states, sort_keys=True) if states else '-':>24} "
              f"{sum(s == 200 for s, _t, _e in loaded):>4} {len(lost):>5} "
              f"{statistics.median(times) * 1000:>7.1f}ms {_percentile(times, 0.95) * 1000:>7.1f}ms "
              f"{statistics.median(alone_times) * 1000:>8.1f}ms {_percentile(alone_times, 0.95) * 1000:>8.1f}ms "
              f"{rss:>6.1f}MiB" + (f"  lost: {sorted(set(lost))}" if lost else ""))
        time.sleep(1)  # let the gateway take the closed slow connections off before the next case
    return lost_total


if __name__ == "__main__":
    sys.exit(main())
