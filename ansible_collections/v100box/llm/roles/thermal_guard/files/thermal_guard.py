#!/usr/bin/python3
"""v100-llm-box thermal guard and GPU power limits (installed by roles/thermal_guard; Python standard library only).

``thermal_guard.py watch --config FILE`` samples every GPU with nvidia-smi each ``interval_s`` seconds. A GPU at
``warn_c`` (or its memory at ``memory_warn_c``) gets one "warn" event per episode; one at ``stop_c`` (or memory at
``memory_stop_c``) has the managed services stopped through systemctl; once every GPU is at or below ``resume_c``
(and every memory below ``memory_warn_c``) they are started again. The guard starts them again at most
``max_restarts`` times in a rolling hour: the stop after that leaves them stopped with a "limit" event, until the
guard itself is restarted. A failing nvidia-smi is one "error" event per episode; the guard keeps running.

Every event is a JSON line appended to the events file and the same message on stdout (the journal, with a
syslog priority prefix).

``thermal_guard.py power-limit --config FILE`` (the oneshot v100box-power-limit.service) turns persistence mode
on, sets each listed GPU's limit with ``nvidia-smi -i N -pl W`` and writes what it applied to ``--state``;
``--reset`` puts the GPUs of that record back to their default limit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

SAMPLE_QUERY = ("index,uuid,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.mem,"
                "clocks_throttle_reasons.active")
POWER_QUERY = "index,power.min_limit,power.max_limit,power.default_limit"
CSV_FORMAT = "--format=csv,noheader,nounits"
NOT_AVAILABLE = {"", "[N/A]", "N/A", "[Not Supported]", "Not Supported"}
HOUR_S = 3600.0
# sd-daemon priority prefixes journald reads from a service's stdout
PRIORITY = {"warn": "<4>", "stop": "<4>", "start": "<5>", "limit": "<3>", "error": "<3>"}


@dataclass(frozen=True)
class Config:
    services: tuple[str, ...] = ()
    warn_c: float = 80
    stop_c: float = 85
    resume_c: float = 75
    memory_warn_c: float = 85
    memory_stop_c: float = 90
    interval_s: float = 5
    max_restarts: int = 3
    events: str = "/var/lib/v100box/thermal-guard/events.jsonl"
    state: str = "/var/lib/v100box/thermal-guard/state.json"
    # Absolute paths: a root service never looks a tool up on PATH (/usr/local/bin comes first there).
    nvidia_smi: str = "/usr/bin/nvidia-smi"
    systemctl: str = "/usr/bin/systemctl"

    @classmethod
    def load(cls, path: str) -> Config:
        data = json.loads(Path(path).read_text())
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        if "services" in known:
            known["services"] = tuple(known["services"])
        return cls(**known)


@dataclass(frozen=True)
class Reading:
    index: int
    temp_c: float | None
    memory_temp_c: float | None


@dataclass
class State:
    warned: set[int] = field(default_factory=set)  # GPUs in a warning episode
    stopped: bool = False  # the managed services are stopped by the guard
    limited: bool = False  # max_restarts reached: they stay stopped
    restarts: list[float] = field(default_factory=list)  # monotonic times of the guard's starts
    failing: bool = False  # in an error episode


@dataclass(frozen=True)
class Step:
    """What the guard does after a sample: an event to log, and for stop and start the services to act on."""

    kind: str  # warn, stop, start, limit, error
    gpu: int | None
    temp_c: float | None
    memory_temp_c: float | None
    message: str


def number(text: str) -> float | None:
    """A field of nvidia-smi's CSV as a number; "[N/A]" and the like are None."""
    text = text.strip()
    if text in NOT_AVAILABLE:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_sample(text: str) -> list[Reading]:
    """The GPUs of SAMPLE_QUERY's output; raises ValueError on a line that is not one."""
    readings = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [part.strip() for part in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            raise ValueError(f"nvidia-smi printed {line.strip()[:120]!r}, not a reading of {SAMPLE_QUERY}")
        readings.append(Reading(int(fields[0]), number(fields[2]), number(fields[3])))
    return readings


def parse_power(text: str) -> dict[int, dict[str, float | None]]:
    """POWER_QUERY's output: per GPU index its min, max and default limit in watts."""
    ranges = {}
    for line in text.splitlines():
        fields = [part.strip() for part in line.split(",")]
        if len(fields) >= 4 and fields[0].isdigit():
            ranges[int(fields[0])] = {"min": number(fields[1]), "max": number(fields[2]), "default": number(fields[3])}
    return ranges


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _hot(reading: Reading, core: float, memory: float) -> bool:
    return ((reading.temp_c is not None and reading.temp_c >= core)
            or (reading.memory_temp_c is not None and reading.memory_temp_c >= memory))


def _cool(config: Config, reading: Reading) -> bool:
    return ((reading.temp_c is None or reading.temp_c <= config.resume_c)
            and (reading.memory_temp_c is None or reading.memory_temp_c < config.memory_warn_c))


def _describe(reading: Reading) -> str:
    memory = "" if reading.memory_temp_c is None else f", memory {_fmt(reading.memory_temp_c)} °C"
    return f"GPU {reading.index} at {_fmt(reading.temp_c)} °C{memory}"


def decide(config: Config, state: State, readings: list[Reading] | None, now: float,
           error: str = "") -> list[Step]:
    """The guard's decision for one sample (None: nvidia-smi failed with ``error``); updates ``state``."""
    if readings is None or not readings:
        if state.failing:
            return []
        state.failing = True
        why = error or "nvidia-smi lists no GPU"
        message = f"cannot read the GPU temperatures: {why}; the guard keeps trying every {_fmt(config.interval_s)} s"
        return [Step("error", None, None, None, message)]
    state.failing = False
    steps: list[Step] = []
    hot = [r for r in readings if _hot(r, config.stop_c, config.memory_stop_c)]
    if hot and not state.stopped:
        worst = max(hot, key=lambda r: (r.temp_c or 0, r.memory_temp_c or 0))
        state.stopped = True
        state.warned.update(r.index for r in hot)
        steps.append(Step("stop", worst.index, worst.temp_c, worst.memory_temp_c,
                          f"{_describe(worst)} reached the stop level ({_fmt(config.stop_c)} °C, memory "
                          f"{_fmt(config.memory_stop_c)} °C): stopping the llama services"))
        state.restarts = [t for t in state.restarts if now - t < HOUR_S]
        if len(state.restarts) >= config.max_restarts:
            state.limited = True
            steps.append(Step("limit", worst.index, worst.temp_c, worst.memory_temp_c,
                              f"the services were started again {len(state.restarts)} times in the last hour "
                              f"(max_restarts {config.max_restarts}): they stay stopped; find the cooling fault, "
                              f"then start them (systemctl start) and restart v100box-thermal-guard"))
    for reading in readings:
        if reading.index in state.warned:
            if _cool(config, reading):
                state.warned.discard(reading.index)
        elif _hot(reading, config.warn_c, config.memory_warn_c):
            state.warned.add(reading.index)
            steps.append(Step("warn", reading.index, reading.temp_c, reading.memory_temp_c,
                              f"{_describe(reading)} reached the warning level ({_fmt(config.warn_c)} °C, memory "
                              f"{_fmt(config.memory_warn_c)} °C)"))
    if state.stopped and not state.limited and all(_cool(config, r) for r in readings):
        hottest = max(readings, key=lambda r: (r.temp_c or 0, r.memory_temp_c or 0))
        state.stopped = False
        state.restarts.append(now)
        steps.append(Step("start", hottest.index, hottest.temp_c, hottest.memory_temp_c,
                          f"every GPU is at or below {_fmt(config.resume_c)} °C (hottest {_describe(hottest)}): "
                          f"starting the llama services again"))
    return steps


def event(step: Step, service: str | None, when: datetime, message: str | None = None) -> dict:
    """An events-file line (the contract the certify report reads)."""
    return {"time": when.isoformat(timespec="seconds"), "kind": step.kind, "gpu": step.gpu, "temp_c": step.temp_c,
            "memory_temp_c": step.memory_temp_c, "service": service, "message": message or step.message}


def run(argv: list[str], timeout: float = 30, stdout_only: bool = False) -> tuple[int, str]:
    """A command's exit status and output (on success with ``stdout_only``, stdout alone; else stderr after
    stdout); 127 when it cannot be run."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]} is not installed (no NVIDIA driver on this box yet?)"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)} did not answer within {timeout:g} s"
    except OSError as exc:
        return 126, f"{argv[0]}: {exc.strerror}"
    if stdout_only and done.returncode == 0:
        return 0, done.stdout
    return done.returncode, (done.stdout + done.stderr).strip()


def sample(config: Config) -> tuple[list[Reading] | None, str]:
    code, out = run([config.nvidia_smi, f"--query-gpu={SAMPLE_QUERY}", CSV_FORMAT], stdout_only=True)
    if code != 0:
        return None, f"nvidia-smi failed (exit {code}): {out[-300:]}"
    try:
        return parse_sample(out), ""
    except ValueError as exc:
        return None, str(exc)


class Log:
    def __init__(self, path: str):
        self.path = Path(path)

    def write(self, record: dict) -> None:
        print(f"{PRIORITY.get(record['kind'], '<6>')}{record['kind']}: {record['message']}"
              + (f" [{record['service']}]" if record["service"] else ""), flush=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        except OSError as exc:
            print(f"<3>error: cannot append to {self.path}: {exc.strerror}", flush=True)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def load_state(config: Config) -> State:
    """The guard's stop survives its own restart in this boot (its services would otherwise stay stopped)."""
    try:
        saved = json.loads(Path(config.state).read_text())
    except (OSError, ValueError):
        return State()
    return State(stopped=saved.get("boot_id") == _boot_id() and bool(saved.get("stopped")))


def save_state(config: Config, state: State) -> None:
    path = Path(config.state)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".new").write_text(json.dumps({"boot_id": _boot_id(), "stopped": state.stopped}) + "\n")
        path.with_suffix(".new").replace(path)
    except OSError as exc:
        print(f"<3>error: cannot write {path}: {exc.strerror}", flush=True)


def act(config: Config, step: Step, log: Log) -> None:
    """Log one step; for stop and start, act on each managed service through the service manager."""
    when = datetime.now(timezone.utc)  # noqa: UP017 - RHEL 9 boxes run Python 3.9
    if step.kind not in ("stop", "start"):
        log.write(event(step, None, when))
        return
    if not config.services:
        log.write(event(step, None, when, step.message + " (this box has none to manage)"))
        return
    for service in config.services:
        code, out = run([config.systemctl, step.kind, service], timeout=120)
        if code == 0:
            log.write(event(step, service, when))
        else:
            failed = Step("error", step.gpu, step.temp_c, step.memory_temp_c, step.message)
            log.write(event(failed, service, when, f"systemctl {step.kind} {service} failed (exit {code}): {out[-300:]}"))


def watch(config: Config) -> int:
    log = Log(config.events)
    state = load_state(config)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print(f"<6>watching every GPU each {_fmt(config.interval_s)} s: warn {_fmt(config.warn_c)} °C, stop "
          f"{_fmt(config.stop_c)} °C, resume {_fmt(config.resume_c)} °C, memory warn {_fmt(config.memory_warn_c)} °C "
          f"stop {_fmt(config.memory_stop_c)} °C; services: {', '.join(config.services) or 'none'}", flush=True)
    while not stopping:
        readings, error = sample(config)
        was_stopped = state.stopped
        for step in decide(config, state, readings, time.monotonic(), error):
            act(config, step, log)
        if state.stopped != was_stopped:
            save_state(config, state)
        slept = 0.0
        while slept < config.interval_s and not stopping:
            time.sleep(min(0.5, config.interval_s - slept))
            slept += 0.5
    return 0


def power_limit(config_path: str, state_path: str, nvidia_smi: str) -> int:
    """Persistence mode, then each GPU's limit; the record says what was applied and each card's range."""
    wanted = json.loads(Path(config_path).read_text())
    code, out = run([nvidia_smi, "-pm", "1"])
    persistence = code == 0
    print(("<5>" if persistence else "<3>") + f"persistence mode: {out[-300:]}", flush=True)
    code, out = run([nvidia_smi, f"--query-gpu={POWER_QUERY}", CSV_FORMAT], stdout_only=True)
    ranges = parse_power(out) if code == 0 else {}
    limits = []
    for item in wanted.get("limits", []):
        gpu, watts = int(item["gpu"]), int(item["watts"])
        card = ranges.get(gpu, {})
        applied_code, applied_out = run([nvidia_smi, "-i", str(gpu), "-pl", str(watts)])
        limits.append({"gpu": gpu, "watts": watts, "applied": applied_code == 0,
                       "range": [card.get("min"), card.get("max")]})
        print(("<5>" if applied_code == 0 else "<3>") + f"GPU {gpu}: power limit {watts} W: {applied_out[-300:]}",
              flush=True)
    record = {"persistence": persistence, "limits": limits}
    path = Path(state_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".new").write_text(json.dumps(record, indent=2) + "\n")
    path.with_suffix(".new").replace(path)
    return 0 if all(item["applied"] for item in limits) else 1


def power_reset(state_path: str, nvidia_smi: str) -> int:
    """Put the GPUs of the record back to their default limit and drop the record."""
    path = Path(state_path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    code, out = run([nvidia_smi, f"--query-gpu={POWER_QUERY}", CSV_FORMAT], stdout_only=True)
    ranges = parse_power(out) if code == 0 else {}
    failed = False
    for item in record.get("limits", []):
        default = ranges.get(int(item["gpu"]), {}).get("default")
        if default is not None:
            failed = run([nvidia_smi, "-i", str(item["gpu"]), "-pl", f"{default:g}"])[0] != 0 or failed
    path.unlink(missing_ok=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    guard = commands.add_parser("watch", help="run the thermal guard")
    guard.add_argument("--config", required=True)
    power = commands.add_parser("power-limit", help="apply the GPU power limits")
    power.add_argument("--config", required=True)
    power.add_argument("--state", default="/var/lib/v100box/power-limit.json")
    power.add_argument("--nvidia-smi", default="/usr/bin/nvidia-smi")
    power.add_argument("--reset", action="store_true", help="put the recorded GPUs back to their default limit")
    args = parser.parse_args(argv)
    os.umask(0o022)
    if args.command == "watch":
        return watch(Config.load(args.config))
    if args.reset:
        return power_reset(args.state, args.nvidia_smi)
    return power_limit(args.config, args.state, args.nvidia_smi)


if __name__ == "__main__":
    sys.exit(main())
