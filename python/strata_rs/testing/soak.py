"""Load, faults and crashes against a real `strata-rs serve` on loopback, with every answer checked.

`run_load` drives many streaming clients for a while: random prompts from a pool of growing
conversations, random lengths, random cancels and abrupt disconnects, more clients than the
server admits (so some get 503). With `faults`, it also injects the cache's faults at random
points (`--cache-faults` with `P%` rules and a `ram_gate` window), makes the disk tier's folder
read-only for part of the run and truncates the tier's files. Every answer is compared with the
Python API's answer on a fresh engine with the tiers off (the cold path); the report lists what
broke a promise (`SoakReport.problems`).

`run_crashes` kills the server with SIGKILL while it writes the disk tier, several times, and
checks that each restart adopts exactly the complete, valid files (verified here, independently,
with `verify_block_file`) and still answers exactly.

`benches/soak.py` runs both for minutes and prints the figures; the default tests run them for
seconds (tests/test_soak.py). Needs httpx and xxhash (the `bench` or `test` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from strata_rs import Engine
from strata_rs.testing.models import make_model
from strata_rs.testing.server import Server, serve_argv

# Answer lengths a request asks for (max_tokens); every (prompt, length) has a reference.
LENGTHS = (1, 4, 12)
# The tiny model's vocabulary has 512 ids; ordinary ones only.
VOCAB = range(3, 500)


def conversations(seed: int, count: int = 16, turns: int = 4) -> list[list[int]]:
    """Prompts of `count` conversations, each growing over `turns` turns: a 200-600 id history,
    then 16-64 ids more per turn (what a returning user adds)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids = [rng.choice(VOCAB) for _ in range(rng.randint(200, 600))]
        for _ in range(turns):
            prompts.append(list(ids))
            ids += [rng.choice(VOCAB) for _ in range(rng.randint(16, 64))]
    return prompts


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    completion_tokens: int


async def reference_answers(model: Path, prompts: Sequence[list[int]]) -> dict[Any, Answer]:
    """(prompt index, max_tokens) -> the cold path's greedy answer (a fresh engine, tiers off)."""
    engine = await Engine.load(
        model, max_batch=8, max_waiting=1 << 20, host_cache_mib=0, disk_cache_mib=0
    )
    try:
        keys = [(i, n) for i in range(len(prompts)) for n in LENGTHS]
        done = await asyncio.gather(
            *(engine.complete(prompts[i], max_tokens=n, temperature=0.0) for i, n in keys)
        )
        return {
            k: Answer(c.text, c.finish_reason, c.usage.completion_tokens)
            for k, c in zip(keys, done, strict=True)
        }
    finally:
        await engine.close()


# ---- disk tier files, verified independently of the engine ------------------------------------

_FIXED = struct.Struct("<8sIQQB3xIIIIQQ")  # magic .. payload checksum: 64 bytes


def verify_block_file(path: Path) -> str | None:
    """None when `path` is a complete, self-consistent disk tier block file, else what is wrong.
    Reads the format of rust/cache/disk.rs (header, token ids, header checksum, payload) with
    the `xxhash` package's xxh3_64, not with the engine's code."""
    import xxhash

    data = path.read_bytes()
    if len(data) < _FIXED.size:
        return f"{len(data)} bytes, shorter than a header"
    magic, version, salt, block_hash, _dtype, block_size, *_shape, payload_len, payload_sum = (
        _FIXED.unpack_from(data)
    )
    if magic != b"STRATAKV" or version != 1:
        return "bad magic or version"
    header_len = _FIXED.size + 4 * block_size + 8
    if len(data) != header_len + payload_len:
        return f"{len(data)} bytes, the header says {header_len + payload_len}"
    (header_sum,) = struct.unpack_from("<Q", data, header_len - 8)
    if xxhash.xxh3_64_intdigest(data[: header_len - 8]) != header_sum:
        return "header checksum mismatch"
    if xxhash.xxh3_64_intdigest(data[header_len:]) != payload_sum:
        return "payload checksum mismatch"
    if path.name != f"{salt:016x}-{block_hash:016x}.kvb":
        return "the name does not match the header"
    return None


@dataclass
class TierFiles:
    valid: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)
    temp: list[str] = field(default_factory=list)


def scan_tier(folder: Path) -> TierFiles:
    out = TierFiles()
    for p in sorted(folder.iterdir()) if folder.exists() else []:
        if p.name.startswith(".") and ".tmp-" in p.name:
            out.temp.append(p.name)
        elif p.name.endswith(".kvb"):
            why = verify_block_file(p)
            if why is None:
                out.valid.append(p.name)
            else:
                out.invalid[p.name] = why
    return out


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[str | None]:
    """Makes `folder` refuse new files for the body of the `with`; yields how, or None when
    this machine allows no way. root ignores permission bits, so as root the folder is made
    immutable (chattr +i) or bind-mounted read-only."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        try:
            yield "chmod 555"
        finally:
            folder.chmod(mode & 0o7777)
        return
    attempts = (
        ("chattr +i", [["chattr", "+i", str(folder)]], [["chattr", "-i", str(folder)]]),
        (
            "read-only bind mount",
            [
                ["mount", "--bind", str(folder), str(folder)],
                ["mount", "-o", "remount,ro,bind", str(folder)],
            ],
            [["umount", str(folder)]],
        ),
    )
    for how, on, off in attempts:
        if all(_quiet(cmd) for cmd in on) and not _can_create(folder):
            try:
                yield how
            finally:
                for cmd in off:
                    _quiet(cmd)
            return
        for cmd in off:
            _quiet(cmd)
    yield None


def _quiet(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _can_create(folder: Path) -> bool:
    probe = folder / ".probe"
    try:
        probe.touch()
    except OSError:
        return False
    probe.unlink()
    return True


# ---- the load ---------------------------------------------------------------------------------


@dataclass
class SoakReport:
    seconds: float = 0.0
    clients: int = 0
    accepted: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnected: int = 0
    rejected: int = 0
    rejected_without_retry_after: int = 0
    generated_tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    health_checks: int = 0
    health_failures: list[str] = field(default_factory=list)
    rss_after_warmup: int = 0
    rss_at_end: int = 0
    # From the server's /metrics and /v1/cache after the run.
    server: dict[str, Any] = field(default_factory=dict)
    # How the disk tier's folder was made read-only mid-run (None: it was not).
    read_only: str | None = None
    truncated_files: int = 0
    events: list[str] = field(default_factory=list)
    exit_status: int | None = None

    @property
    def rss_ratio(self) -> float:
        return self.rss_at_end / self.rss_after_warmup if self.rss_after_warmup else 0.0

    def problems(self) -> list[str]:
        """Every promise the run broke; empty when it kept them all."""
        s = self.server
        out = [f"wrong answer: {m}" for m in self.mismatches[:5]]
        out += [f"error: {e}" for e in self.errors[:5]]
        out += [f"/health: {h}" for h in self.health_failures[:5]]
        if self.rejected_without_retry_after:
            out.append(f"{self.rejected_without_retry_after} 503s without Retry-After")
        if self.rss_ratio > 1.10:
            out.append(
                f"RSS grew {self.rss_ratio:.3f}x after warm-up "
                f"({self.rss_after_warmup >> 20} -> {self.rss_at_end >> 20} MiB)"
            )
        ended = s.get("requests_finished", 0) + s.get("requests_cancelled", 0)
        if ended != self.accepted:
            out.append(f"{self.accepted} requests accepted, {ended} ended in the engine")
        if s.get("queue_refusals") != self.rejected:
            out.append(f"{self.rejected} 503s, {s.get('queue_refusals')} counted as refusals")
        for name in ("running", "waiting", "kv_blocks_used"):
            if s.get(name) != 0:
                out.append(f"{name} is {s.get(name)} after the run, not 0")
        injected = s.get("faults_injected", {})
        if injected.get("ram_gate", 0) > s.get("refusals", {}).get("ram", 0):
            out.append(f"ram_gate faults {injected['ram_gate']} > RAM refusals {s['refusals']}")
        moved_faults = sum(n for k, n in injected.items() if k != "ram_gate")
        if moved_faults > s.get("failed_moves", 0):
            out.append(f"{moved_faults} injected move faults > {s.get('failed_moves')} failed")
        if self.exit_status not in (None, 0):
            out.append(f"the server exited with {self.exit_status}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rss_ratio": self.rss_ratio, "problems": self.problems()}


def server_counters(url: str) -> dict[str, Any]:
    """The numbers the checks need, from /metrics and /v1/cache."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def one(name: str, **labels: str) -> int:
        return int(values.get((name, tuple(sorted(labels.items()))), 0))

    moves = [
        (dict(labels), int(v))
        for (name, labels), v in values.items()
        if name == "strata:cache_moves_total"
    ]
    cache = httpx.get(url + "/v1/cache", timeout=30).json()
    return {
        "running": one("strata:num_requests_running"),
        "waiting": one("strata:num_requests_waiting"),
        "kv_blocks_used": one("strata:kv_blocks_used"),
        "requests_finished": one("strata:requests_finished_total"),
        "requests_cancelled": one("strata:requests_cancelled_total"),
        "queue_refusals": one("strata:admission_refusals_total", gate="queue"),
        "preemptions": one("strata:num_preemptions_total"),
        "generated_tokens": one("strata:generation_tokens_total"),
        "moves": {f"{m['from']}->{m['to']} {m['result']}": n for m, n in moves if n},
        "failed_moves": sum(n for m, n in moves if m["result"] == "failed"),
        "refusals": cache["refusals"],
        "faults_injected": cache["faults_injected"],
        "corrupt_files": cache["corrupt_files"],
        "hit_tokens": {t["tier"]: t["hit_tokens"] for t in cache["tiers"]},
    }


class _Load:
    """The clients of one run, and what they saw."""

    def __init__(
        self,
        url: str,
        prompts: Sequence[list[int]],
        answers: dict[Any, Answer],
        report: SoakReport,
    ) -> None:
        self.url = url
        self.prompts = prompts
        # The prompts the clients draw from (indices into `prompts`).
        self.pick: Sequence[int] = range(len(prompts))
        self.answers = answers
        self.report = report
        self.http = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(120.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
        )

    def check(self, key: tuple[int, int], text: str, finish: str | None, tokens: int) -> None:
        want = self.answers[key]
        got = Answer(text, finish or "", tokens)
        if got != want:
            self.report.mismatches.append(f"prompt {key[0]} max_tokens {key[1]}: {got} != {want}")
        else:
            self.report.completed += 1
            self.report.generated_tokens += tokens

    async def rejected(self, r: httpx.Response) -> None:
        """A 503: it must say when to come back; the client waits a random part of that."""
        await r.aread()
        self.report.rejected += 1
        retry = r.headers.get("retry-after", "")
        body = r.json()
        if not retry.isdigit() or body.get("error", {}).get("code") != "engine_busy":
            self.report.rejected_without_retry_after += 1
            self.report.errors.append(f"bad 503: {r.headers} {body}")
            return
        await asyncio.sleep(random.uniform(0.05, 1.0) * int(retry))

    async def streamed(self, key: tuple[int, int], cancel_after: int) -> None:
        body = {
            "prompt": self.prompts[key[0]],
            "max_tokens": key[1],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 503:
                await self.rejected(r)
                return
            if r.status_code != 200:
                await r.aread()
                self.report.errors.append(f"stream {r.status_code}: {r.text[:200]}")
                return
            self.report.accepted += 1
            text, finish, tokens, events = "", None, None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                if events > cancel_after:
                    # Closing the response mid-stream closes the connection: a client gone.
                    self.report.cancelled += 1
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.report.errors.append(f"stream error event: {chunk}")
                    return
                for c in chunk["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            self.check(key, text, finish, tokens if tokens is not None else -1)

    async def whole(self, key: tuple[int, int]) -> None:
        body = {"prompt": self.prompts[key[0]], "max_tokens": key[1], "temperature": 0}
        r = await self.http.post("/v1/completions", json=body)
        if r.status_code == 503:
            await self.rejected(r)
            return
        if r.status_code != 200:
            self.report.errors.append(f"{r.status_code}: {r.text[:200]}")
            return
        self.report.accepted += 1
        out = r.json()
        choice = out["choices"][0]
        self.check(key, choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"])

    async def dropped(self, rng: random.Random, key: tuple[int, int]) -> None:
        """A client that sends a streaming request, reads a little and resets the connection."""
        host, port = self.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(
            {"prompt": self.prompts[key[0]], "max_tokens": key[1], "stream": True}
        ).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        # "HTTP/1.1 200", then whatever else has come of the answer.
        head = await reader.readexactly(12)
        head += await reader.read(rng.randint(0, 600))
        status = head[9:12]
        sock = writer.get_extra_info("socket")
        # SO_LINGER 0: close with a reset, as a crashed client or a dropped network does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        if status == b"503":
            self.report.rejected += 1
        elif status == b"200":
            self.report.accepted += 1
            self.report.disconnected += 1
        else:
            self.report.errors.append(f"dropped client got {head[:80]!r}")

    async def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            key = (rng.choice(self.pick), rng.choice(LENGTHS))
            roll = rng.random()
            try:
                if roll < 0.6:
                    await self.streamed(key, cancel_after=1 << 30)
                elif roll < 0.75:
                    await self.whole(key)
                elif roll < 0.9:
                    await self.streamed(key, cancel_after=rng.randint(0, key[1]))
                else:
                    await self.dropped(rng, key)
            except (httpx.HTTPError, OSError, ValueError) as e:
                self.report.errors.append(f"{type(e).__name__}: {e}")

    async def health(self, until: float) -> None:
        while time.monotonic() < until:
            try:
                r = await self.http.get("/health")
                if r.status_code != 200:
                    self.report.health_failures.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                self.report.health_failures.append(f"{type(e).__name__}: {e}")
            self.report.health_checks += 1
            await asyncio.sleep(0.5)


@dataclass
class LoadOptions:
    seconds: float = 300.0
    warmup: float = 20.0
    clients: int = 64
    faults: bool = True
    seed: int = 0
    max_batch: int = 8
    max_waiting: int = 24


def fault_spec(rng: random.Random) -> str:
    """Faults at random points of every kind, and a window in which the RAM gate refuses."""
    start = rng.randint(20, 300)
    return (
        "alloc:1%,copy_out:1%,copy_in:2%,write:2%,read:3%,ram_gate:2%,"
        f"ram_gate:{start}-{start + rng.randint(20, 100)}"
    )


def tiny_model(folder: Path) -> Path:
    """The tiny test model with room for the soak's conversations."""
    return make_model(folder, "llama", "tiny", "f32", 0, max_position_embeddings=1024)


def serve_flags(model: Path, kv_dir: Path, max_batch: int, max_waiting: int) -> list[str]:
    # A device pool of ~2 long conversations, a host tier of ~10 and a disk tier of ~20 (the
    # pool of prompts is ~40 conversations' worth): turns keep moving between the tiers, and the
    # disk keeps writing. Floor 0: the RAM gate admits unless a fault says otherwise.
    return [
        "--model", str(model), "--max-context", "1024", "--kv-memory-mib", "1",
        "--max-batch", str(max_batch), "--max-waiting", str(max_waiting),
        "--host-cache-mib", "2", "--host-min-free-mib", "0",
        "--disk-cache-dir", str(kv_dir), "--disk-cache-mib", "4", "--disk-cache-days", "0",
        "--threads", "2",
    ]  # fmt: skip


def run_load(opts: LoadOptions, model: Path | None = None, echo: bool = False) -> SoakReport:
    """Starts a server, runs the load (and the faults) and stops it; the report of the run."""
    rng = random.Random(opts.seed)
    with tempfile.TemporaryDirectory(prefix="strata-soak-") as tmp:
        work = Path(tmp)
        model = model or tiny_model(work / "model")
        prompts = conversations(opts.seed)
        answers = asyncio.run(reference_answers(model, prompts))
        kv_dir = work / "kv"
        kv_dir.mkdir(mode=0o700)
        env = {"STRATA_CACHE_FAULTS": fault_spec(rng)} if opts.faults else {}
        server = Server(
            serve_argv(*serve_flags(model, kv_dir, opts.max_batch, opts.max_waiting)),
            env=env,
            echo=echo,
        )
        report = SoakReport(clients=opts.clients)
        try:
            server.wait_healthy()
            asyncio.run(_drive(server, opts, rng, kv_dir, prompts, answers, report))
        finally:
            report.exit_status = server.stop()
        if opts.faults:
            report.events.append(f"faults: {env['STRATA_CACHE_FAULTS']}")
        return report


async def _drive(
    server: Server,
    opts: LoadOptions,
    rng: random.Random,
    kv_dir: Path,
    prompts: Sequence[list[int]],
    answers: dict[Any, Answer],
    report: SoakReport,
) -> None:
    load = _Load(server.url, prompts, answers, report)
    started = time.monotonic()
    until = started + opts.warmup + opts.seconds
    tasks = [
        asyncio.create_task(load.client(opts.seed * 1000 + i, until)) for i in range(opts.clients)
    ]
    tasks.append(asyncio.create_task(load.health(until)))
    await asyncio.sleep(opts.warmup)
    report.rss_after_warmup = server.rss_bytes()
    if opts.faults:
        await _faults(opts, rng, kv_dir, report, started)
    await asyncio.gather(*tasks)
    report.seconds = time.monotonic() - started
    await load.http.aclose()
    # Cancelled and dropped streams end in the engine at its next step; then all is idle.
    deadline = time.monotonic() + 30
    while True:
        report.server = server_counters(server.url)
        idle = report.server["running"] == 0 and report.server["waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    report.rss_at_end = server.rss_bytes()


async def _faults(
    opts: LoadOptions, rng: random.Random, kv_dir: Path, report: SoakReport, started: float
) -> None:
    """During the run: the disk tier's folder read-only for a fifth of it, then every file of
    the tier truncated to half (the cache's own faults run the whole time)."""
    t0 = time.monotonic()

    async def at(fraction: float) -> None:
        await asyncio.sleep(max(0.0, t0 + fraction * opts.seconds - time.monotonic()))

    await at(0.2)
    with read_only(kv_dir) as how:
        report.read_only = how
        report.events.append(f"{time.monotonic() - started:.1f} s: disk tier read-only ({how})")
        await at(0.4)
    report.events.append(f"{time.monotonic() - started:.1f} s: disk tier writable again")
    await at(0.6)
    files = sorted(kv_dir.glob("*.kvb"))
    for f in files:
        with contextlib.suppress(OSError):
            os.truncate(f, f.stat().st_size // 2)
    report.truncated_files = len(files)
    report.events.append(f"{time.monotonic() - started:.1f} s: truncated {len(files)} tier files")


# ---- crashes ----------------------------------------------------------------------------------


@dataclass
class CrashReport:
    cycles: list[dict[str, Any]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = [f"wrong answer: {m}" for m in self.mismatches[:5]]
        out += [f"error: {e}" for e in self.errors[:5]]
        for c in self.cycles:
            adopted_all = c["adopted"] == c["valid_before"] and not c["invalid_before"]
            if not adopted_all or c["temp_deleted"] != c["temp_before"]:
                out.append(f"cycle {c['cycle']}: {c}")
        if not any(c["disk_hit_tokens"] for c in self.cycles[1:]):
            out.append("no restart served a prompt from the disk tier")
        return out


def run_crashes(
    cycles: int = 5, seed: int = 0, model: Path | None = None, echo: bool = False
) -> CrashReport:
    """Kills the server with SIGKILL while clients keep it writing the disk tier (host tier off:
    every evicted block goes to disk), `cycles` times: in even cycles at a random moment, in odd
    ones the moment a block file is half written (its temp file exists). Each cycle brings new
    conversations, so there is always something to write, and first asks again for some of the
    earlier cycles', which the restart must serve from the files it adopted. Before each restart
    the folder is checked here, independently of the engine. The last start asks every prompt
    and is stopped cleanly."""
    rng = random.Random(seed)
    report = CrashReport()
    per_cycle = 8 * 4
    prompts = [p for c in range(cycles + 1) for p in conversations(seed + 1 + c, count=8)]
    with tempfile.TemporaryDirectory(prefix="strata-crash-") as tmp:
        work = Path(tmp)
        model = model or tiny_model(work / "model")
        answers = asyncio.run(reference_answers(model, prompts))
        kv_dir = work / "kv"
        flags = serve_flags(model, kv_dir, max_batch=4, max_waiting=64)
        flags[flags.index("--host-cache-mib") + 1] = "0"
        # Room for every cycle's conversations: a restart finds all that was written.
        flags[flags.index("--disk-cache-mib") + 1] = "64"
        flags[flags.index("--disk-cache-days") + 1] = "1"
        for cycle in range(cycles + 1):
            last = cycle == cycles
            before = scan_tier(kv_dir)
            server = Server(serve_argv(*flags), echo=echo)
            try:
                server.wait_healthy()
                cache = httpx.get(server.url + "/v1/cache", timeout=30).json()
                scan = next(x for x in server.lines if "disk tier " in x and " adopted " in x)
                temp_deleted = int(scan.rsplit(" temp files", 1)[0].rsplit(" ", 1)[1])
                load = _Load(server.url, prompts, answers, SoakReport())
                earlier = range(max(1, cycle) * per_cycle)
                returning = range(len(prompts)) if last else rng.sample(earlier, 8)
                load.pick = range(cycle * per_cycle, (cycle + 1) * per_cycle)
                mid_write = cycle % 2 == 1
                kill = None if last else (mid_write, kv_dir)
                hits, seconds = asyncio.run(_crash_cycle(load, server, rng, returning, kill))
                report.mismatches += load.report.mismatches
                report.errors += load.report.errors
            finally:
                if last:
                    status = server.stop()
                    if status != 0:
                        report.errors.append(f"clean stop exited {status}")
                else:
                    server.kill()
            after = scan_tier(kv_dir)
            report.cycles.append(
                {
                    "cycle": cycle,
                    "valid_before": len(before.valid),
                    "invalid_before": before.invalid,
                    "temp_before": len(before.temp),
                    "temp_deleted": temp_deleted,
                    "adopted": cache["adopted_files"],
                    "corrupt_deleted": cache["corrupt_files"],
                    "disk_hit_tokens": hits,
                    "kill": "clean stop" if last else ("mid-write" if mid_write else "random"),
                    "killed_after_s": round(seconds, 2),
                    "answers_checked": load.report.completed,
                    "valid_after": len(after.valid),
                    "temp_after": len(after.temp),
                }
            )
    return report


def _kill_mid_write(server: Server, kv_dir: Path, after: float, limit: float) -> None:
    """Waits `after` seconds, then SIGKILLs the server as soon as a temp file (a block being
    written) shows in `kv_dir`, or at `limit` seconds."""
    start = time.monotonic()

    def temps() -> set[str]:
        with os.scandir(kv_dir) as it:
            return {e.name for e in it if e.name.startswith(".") and ".tmp-" in e.name}

    old = temps()
    time.sleep(after)
    while time.monotonic() - start < limit and not temps() - old:
        time.sleep(0.0002)
    server.proc.kill()


async def _crash_cycle(
    load: _Load,
    server: Server,
    rng: random.Random,
    returning: Sequence[int],
    kill: tuple[bool, Path] | None,
) -> tuple[int, float]:
    """Asks the `returning` prompts one at a time, then (when `kill` is given) runs four
    clients until the server is killed: `(mid_write, kv_dir)`. The disk hits of the returning
    prompts and the seconds from the start of the load to the kill."""
    try:
        for i in returning:
            await load.streamed((i, LENGTHS[-1]), cancel_after=1 << 30)
        hits = server_counters(load.url)["hit_tokens"]["disk"]
        if kill is None:
            return hits, 0.0
        mid_write, kv_dir = kill
        started = time.monotonic()
        if mid_write:
            killer = asyncio.create_task(
                asyncio.to_thread(_kill_mid_write, server, kv_dir, rng.uniform(0.3, 1.5), 8.0)
            )
        else:
            loop = asyncio.get_running_loop()
            loop.call_later(rng.uniform(1.5, 4.0), server.proc.kill)
        checked = len(load.report.errors)

        async def until_killed() -> None:
            while server.proc.poll() is None:
                await asyncio.sleep(0.05)

        clients = [load.client(rng.randrange(1 << 30), time.monotonic() + 30) for _ in range(4)]
        waiter = asyncio.create_task(until_killed())
        runs = [asyncio.create_task(c) for c in clients]
        await waiter
        seconds = time.monotonic() - started
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        if mid_write:
            await killer
        # Requests in flight at the kill fail: that is the point, not an error.
        del load.report.errors[checked:]
        return hits, seconds
    finally:
        await load.http.aclose()
