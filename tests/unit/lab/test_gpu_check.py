"""The GPU check's parts that need no GPU (lab/gpu_check): the cases and their truth, the nvidia-smi answers read by
the product's parsers, the trace analysis against the rendered llama_service unit, the build's flags, and that
nothing it starts outlives it. The recorded H100 run is ../shared/fixtures/gpu-h100-580 (read when present)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from lab.gpu_check import build, cases, procs, smi, trace, unit

RECORDED = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "gpu-h100-580"
SYSCALL_FILTER = Path(__file__).resolve().parents[2] / "fixtures" / "gpu_check" / "syscall-filter-systemd252.txt"


@pytest.fixture(scope="module")
def recorded() -> Path:
    if not RECORDED.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{RECORDED} is missing; CI runs with shared/ beside the clone")
        pytest.skip("../shared/fixtures/gpu-h100-580 is not beside this clone")
    return RECORDED


def _answer(path: Path) -> str:
    """A recorded nvidia-smi answer without the ``rc=N`` line the recording appended to some files."""
    lines = path.read_text().splitlines()
    while lines and lines[-1].startswith("rc="):
        lines.pop()
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def gpu0_unit() -> unit.UnitPolicy:
    """The role's unit for one instance on GPU 0 (minor 0), rendered by Ansible as the box gets it."""
    return unit.parse_unit(unit.render_unit([{"index": 0, "minor_number": 0}]))


@pytest.fixture(scope="module")
def groups() -> dict[str, list[str]]:
    return unit.read_syscall_groups(SYSCALL_FILTER.read_text())


# ---- cases ---------------------------------------------------------------------------------------------------

def test_the_cases_are_the_recorded_ones(recorded):
    for case in cases.CASES:
        record = json.loads((recorded / "cuda-truth" / f"{case['name']}.json").read_text())
        assert record["case"] == case
    assert {c["name"] for c in cases.CASES} == {p.stem for p in (recorded / "cuda-truth").glob("*.json")}


def test_truth_read_from_each_recorded_log_is_the_recorded_truth(recorded):
    for case in cases.CASES:
        record = json.loads((recorded / "cuda-truth" / f"{case['name']}.json").read_text())
        truth = cases.truth_from_log((recorded / "cuda-truth" / f"{case['name']}.log").read_text())
        expected = {k: v for k, v in record["truth"].items() if k not in ("health_s", "server_cmd")}
        assert truth == expected, case["name"]


def test_each_case_runs_the_recorded_server_command(recorded):
    for case in cases.CASES:
        command = json.loads((recorded / "cuda-truth" / f"{case['name']}.json").read_text())["truth"]["server_cmd"]
        port = int(command[command.index("--port") + 1])
        assert ["llama-server", *cases.server_args(case, command[2], port)] == command


def test_cases_with_one_model_share_its_file_and_unknown_names_are_refused():
    files = {cases.model_file(c["model"]) for c in cases.CASES}
    assert len(files) == 6  # four llama e1024 cases and two qwen3moe cases share theirs
    assert cases.model_kwargs(cases.CASES[2]["model"])["head_dim"] is None  # 0 in the record: n_embd / n_head
    assert cases.model_kwargs(cases.CASES[0]["model"])["sliding_window"] == 96
    with pytest.raises(KeyError, match="unknown case"):
        cases.select(["no-such-case"])


# ---- nvidia-smi ---------------------------------------------------------------------------------------------

def test_the_queries_are_the_products_own():
    parsers = smi.load_parsers()
    assert parsers.missing == []
    queries = {q.file: q for q in smi.product_queries(parsers)}
    # the guard and the burn-in ask the same sample; the guard's script and the role's preflight the same range
    assert queries["guard-sample.csv"].args[0] == f"--query-gpu={parsers.guard.SAMPLE_QUERY}"
    assert set(queries["guard-sample.csv"].users) == {"thermal guard sample", "burn-in sample"}
    assert len(queries["guard-power.csv"].users) == 2
    assert queries["box-state.csv"].args == (f"--query-gpu={parsers.box_state.GPU_QUERY}", "--format=csv")
    assert queries["driver-gpus.csv"].args[0].startswith("--query-gpu=index,pci.bus_id")


def test_the_driver_580_answers_are_read_by_the_products_parsers(recorded):
    parsers = smi.load_parsers()
    queries = smi.product_queries(parsers)
    outputs = {name: _answer(recorded / "nvidia-smi" / name)
               for name in ("guard-sample.csv", "guard-power.csv", "box-state.csv")}
    probe = {path.name: path.read_text() for path in (recorded / "probe").iterdir()}
    probe["nvidia-smi-q.txt"] = (recorded / "nvidia-smi" / "smi-q.txt").read_text()
    answers = {a.file: a for a in smi.check_outputs(parsers, queries, outputs, probe)}
    for name in ("guard-sample.csv", "guard-power.csv", "box-state.csv", "probe"):
        assert answers[name].status == "pass", answers[name].line()
    assert answers["driver-gpus.csv"].status == "skip"  # not in the recording
    assert "200-700 W" in answers["guard-power.csv"].parsed
    assert "NVIDIA H100 80GB HBM3" in answers["probe"].parsed and "minor 0" in answers["probe"].parsed


def test_an_answer_the_parsers_cannot_read_fails_with_the_reason():
    parsers = smi.load_parsers()
    queries = smi.product_queries(parsers)
    outputs = {"guard-sample.csv": "No devices were found\n", "guard-power.csv": "0, [N/A], [N/A], [N/A]\n",
               "box-state.csv": "index, name\n", "driver-gpus.csv": "0, 00000000:00:06.0, NVIDIA H100\n"}
    answers = {a.file: a for a in smi.check_outputs(parsers, queries, outputs, None,
                                                    {"box-state.csv": 0, "driver-gpus.csv": 0})}
    assert answers["guard-sample.csv"].status == "fail" and "No devices were found" in answers["guard-sample.csv"].line()
    assert "no min, max, default power limit" in answers["guard-power.csv"].line()
    assert answers["box-state.csv"].problems == ["no GPU read"]
    assert "not index, pci.bus_id, name, driver_version" in answers["driver-gpus.csv"].line()
    failed = smi.check_outputs(parsers, queries, {"box-state.csv": "NVIDIA-SMI has failed\n"}, None,
                               {"box-state.csv": 9})
    assert next(a for a in failed if a.file == "box-state.csv").problems[0].startswith("nvidia-smi exited 9")


# ---- the unit and systemd's groups ----------------------------------------------------------------------------

def test_system_service_minus_privileged_is_resolved_from_systemds_groups(groups):
    policy = unit.resolve_filter(["@system-service", "~@privileged"], groups)
    assert policy.allow_list
    assert policy.allowed("openat") and policy.allowed("ioctl") and policy.allowed("mmap")
    assert not policy.allowed("mount") and not policy.allowed("chown") and not policy.allowed("setuid")
    deny = unit.resolve_filter(["~@mount"], groups)
    assert not deny.allow_list and deny.allowed("openat") and not deny.allowed("mount")


def test_the_rendered_unit_is_read_as_a_policy(gpu0_unit):
    assert gpu0_unit.syscall_filter == ["@system-service", "~@privileged"]
    assert gpu0_unit.device_policy == "closed"
    assert ("/dev/nvidia0", "rw") in gpu0_unit.device_allow and ("/dev/nvidiactl", "rw") in gpu0_unit.device_allow
    assert "AF_INET" in gpu0_unit.address_families and "AF_NETLINK" not in gpu0_unit.address_families


def test_an_empty_list_directive_resets_what_came_before_it():
    policy = unit.parse_unit("[Service]\nSystemCallFilter=@system-service\nSystemCallFilter=\nSystemCallFilter=~ @mount\n"
                             "DeviceAllow=/dev/nvidia0 rw\nDeviceAllow=\nDeviceAllow=/dev/nvidiactl\n"
                             "RestrictAddressFamilies=AF_UNIX\nRestrictAddressFamilies=\n"
                             "RestrictAddressFamilies=AF_INET AF_INET6\nRestrictAddressFamilies=AF_NETLINK\n")
    assert policy.syscall_filter == ["~@mount"]
    assert policy.device_allow == [("/dev/nvidiactl", "rwm")]
    assert policy.address_families == ["AF_INET", "AF_INET6", "AF_NETLINK"]
    assert unit.parse_unit("RestrictAddressFamilies=AF_UNIX\nRestrictAddressFamilies=~AF_PACKET\n").address_families \
        == ["~", "AF_PACKET"]


# ---- the trace ------------------------------------------------------------------------------------------------

def _recorded_trace(recorded: Path) -> trace.TraceFacts:
    return trace.recorded_facts((recorded / "cuda-syscalls.txt").read_text(),
                                (recorded / "cuda-paths-opened.txt").read_text())


def test_the_recorded_files_are_written_back_in_their_own_format(recorded):
    facts = _recorded_trace(recorded)
    assert trace.format_syscalls(facts) == (recorded / "cuda-syscalls.txt").read_text()
    assert trace.format_paths(facts) == (recorded / "cuda-paths-opened.txt").read_text()


def test_the_recorded_cuda_server_stays_inside_the_unit_for_gpu_0(recorded, gpu0_unit, groups):
    facts = _recorded_trace(recorded)
    nodes = trace.parse_dev_nodes((recorded / "nvidia-smi" / "dev-nodes.txt").read_text())
    assert nodes["/dev/nvidiactl"] == (195, 255) and nodes["/dev/nvidia-caps/nvidia-cap1"] == (241, 1)
    resolved = unit.resolve_filter(gpu0_unit.syscall_filter, groups)
    checks = {c.name: c for c in trace.check_trace(facts, gpu0_unit, resolved, nodes)}
    assert checks["system calls"].status == "pass", checks["system calls"].line()
    assert "all 60 allowed" in checks["system calls"].detail
    assert checks["devices"].status == "pass", checks["devices"].line()
    # /dev/char/195:0 and 238:0 are the card's and UVM's nodes under their numbers
    assert "/dev/nvidia0" in checks["devices"].detail and "/dev/nvidia-uvm" in checks["devices"].detail
    assert checks["/proc"].status == "note" and "/proc/driver/nvidia/params" in checks["/proc"].detail
    # what the two recorded files do not hold is said to be missing, not passed
    assert checks["socket families"].status == "skip" and checks["write+execute memory"].status == "skip"


def test_a_unit_for_another_card_or_a_narrower_filter_refuses_the_recorded_server(recorded, gpu0_unit, groups):
    facts = _recorded_trace(recorded)
    nodes = trace.parse_dev_nodes((recorded / "nvidia-smi" / "dev-nodes.txt").read_text())
    other_card = unit.UnitPolicy(**{**gpu0_unit.__dict__, "device_allow": [
        ("/dev/nvidia1", "rw"), ("/dev/nvidiactl", "rw"), ("/dev/nvidia-uvm", "rw")]})
    devices = trace.check_devices(facts, other_card, nodes)
    assert devices.status == "fail" and "/dev/nvidia0" in devices.detail and "/dev/char/195:0 (/dev/nvidia0)" in devices.detail
    narrow = unit.resolve_filter(["@system-service", "~@privileged @network-io"], groups)
    calls = trace.check_syscalls(facts, gpu0_unit, narrow)
    assert calls.status == "fail" and "socket" in calls.detail and "bind" in calls.detail
    proc_pid = unit.UnitPolicy(**{**gpu0_unit.__dict__, "proc_subset": "pid"})
    assert trace.check_proc(facts, proc_pid).status == "fail"


STRACE = """\
5531  execve("/opt/llama/bin/llama-server", ["llama-server", "-m", "/dev/x"], 0x7ffd /* 20 vars */) = 0
5531  openat(AT_FDCWD, "/proc/driver/nvidia/params", O_RDONLY) = 3
5531  openat(AT_FDCWD, "/dev/nvidiactl", O_RDWR|O_CLOEXEC <unfinished ...>
5535  futex(0x7f00, FUTEX_WAIT_PRIVATE, 0, NULL <unfinished ...>
5531  <... openat resumed>)              = 4
5535  <... futex resumed>)               = 0
5531  symlink("../nvidiactl", "/dev/char/195:255") = -1 EACCES (Permission denied)
5531  openat(AT_FDCWD, "/dev/nvidia-uvm-tools", O_RDWR) = -1 ENOENT (No such file or directory)
5531  openat(AT_FDCWD, "/dev/char/195:0", O_RDWR|O_CLOEXEC) = 5
5531  socket(AF_UNIX, SOCK_SEQPACKET|SOCK_CLOEXEC, 0) = 6
5531  socket(AF_NETLINK, SOCK_RAW|SOCK_CLOEXEC, NETLINK_ROUTE) = 7
5531  mmap(NULL, 4096, PROT_READ|PROT_WRITE|PROT_EXEC, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) = 0x7f0000000000
5531  mprotect(0x7f0000001000, 4096, PROT_READ|PROT_EXEC) = 0
5531  openat(AT_FDCWD, "/var/lib/llama-service/x/slot.bin", O_WRONLY|O_CREAT|O_TRUNC, 0600) = 8
5531  write(2, "/dev/nvidia7 is not a path", 26) = 26
5540  execve("/usr/bin/nvidia-modprobe", ["nvidia-modprobe", "-u", "-c=0"], 0x7ffd /* 20 vars */) = 0
5531  --- SIGTERM {si_signo=SIGTERM, si_code=SI_USER, si_pid=1, si_uid=0} ---
5540  +++ exited with 0 +++
5531  exit_group(0)                     = ?
"""


def test_a_strace_log_is_read_into_what_the_server_did():
    facts = trace.parse_strace(STRACE)
    assert facts.syscalls["openat"] == 5 and facts.syscalls["futex"] == 1 and "exit_group" in facts.syscalls
    assert facts.devices_opened == {"/dev/nvidiactl", "/dev/char/195:0"}  # write()'s text is no path
    assert facts.failed_device_opens == {"/dev/nvidia-uvm-tools": "ENOENT"}
    assert facts.paths["/dev/char/195:255"] == 1 and facts.paths["/proc/driver/nvidia/params"] == 1
    assert dict(facts.socket_families) == {"AF_UNIX": 1, "AF_NETLINK": 1}
    assert len(facts.wx_mappings) == 1 and len(facts.exec_mprotects) == 1
    assert facts.programs == ["/opt/llama/bin/llama-server", "/usr/bin/nvidia-modprobe"]
    assert ("openat", "/var/lib/llama-service/x/slot.bin", False) in facts.writes
    assert ("symlink", "/dev/char/195:255", True) in facts.writes


def test_the_checks_name_what_the_unit_would_refuse(gpu0_unit, groups):
    facts = trace.parse_strace(STRACE)
    nodes = {"/dev/nvidia0": (195, 0), "/dev/nvidiactl": (195, 255)}
    checks = {c.name: c for c in trace.check_trace(facts, gpu0_unit, unit.resolve_filter(gpu0_unit.syscall_filter,
                                                                                      groups), nodes)}
    assert checks["socket families"].status == "fail" and "AF_NETLINK" in checks["socket families"].detail
    assert checks["devices"].status == "pass" and "/dev/nvidia-uvm-tools (ENOENT)" in checks["devices"].detail
    assert checks["write+execute memory"].status == "note"
    strict = unit.UnitPolicy(**{**gpu0_unit.__dict__, "memory_deny_write_execute": True})
    assert trace.check_write_execute(facts, strict).status == "fail"
    assert checks["programs"].status == "note" and "nvidia-modprobe" in checks["programs"].detail


# ---- the build --------------------------------------------------------------------------------------------------

def test_the_cuda_build_is_the_cpu_build_with_cuda_for_one_card():
    assert build.arch_from_compute_cap("9.0\n") == "90" and build.arch_from_compute_cap("7.0") == "70"
    with pytest.raises(ValueError):
        build.arch_from_compute_cap("[N/A]")
    flags = build.cuda_flags("70", "/usr/local/cuda/bin/nvcc")
    assert "-DGGML_CUDA=ON" in flags and "-DCMAKE_CUDA_ARCHITECTURES=70-real" in flags
    assert "-DGGML_CUDA=OFF" not in flags and "-DGGML_NATIVE=OFF" in flags
    assert build.build_key("70", "a") != build.build_key("90", "a") != build.build_key("90", "b")
    assert build.slim_member("ggml/src/ggml-cuda/mmq.cu") and build.slim_member("tools/ui/index.html")
    assert not build.slim_member("models/ggml-vocab-llama-bpe.gguf") and not build.slim_member("docs/ops/CUDA.csv")


def test_the_slim_source_keeps_long_names_under_llama_cpp_and_leaves_docs_out(tmp_path):
    from lab import engine_build

    prefix = f"llama_cpp_python-{engine_build.SDIST_VERSION}/vendor/llama.cpp/"
    long_name = "ggml/src/ggml-cuda/template-instances/" + "fattn-vec-instance-" + "q" * 90 + ".cu"
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz", format=tarfile.PAX_FORMAT) as archive:
        for name in (long_name, "CMakeLists.txt", "docs/build.md", "models/ggml-vocab-x.gguf", "gguf-py/gguf/x.py"):
            data = name.encode()
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    slim = build.write_source_tarball(tmp_path / "src.tar.xz", sdist)
    with tarfile.open(slim) as archive:
        assert sorted(archive.getnames()) == sorted(f"llama.cpp/{n}" for n in (long_name, "CMakeLists.txt",
                                                                                 "gguf-py/gguf/x.py"))
    work = tmp_path / "work"
    assert (build.Source(slim).extract(work) / long_name).read_text() == long_name
    assert (build.source_gguf_path(build.Source(slim), work) / "gguf" / "x.py").is_file()


# ---- nothing left running ---------------------------------------------------------------------------------------

def test_a_group_stops_every_process_it_started_with_their_children(tmp_path):
    with procs.Group() as group:
        process = group.start(["sh", "-c", "sleep 300 & sleep 300 & wait"], tmp_path / "log")
        time.sleep(0.3)
        kids = procs.children(process.pid)
        assert len(kids) == 2
    assert process.poll() is not None

    def state(pid: int) -> str:
        return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True,
                              check=False).stdout.strip()

    # SIGKILL is delivered at once, but a busy machine may show a killed process running for a moment (it was 'R'
    # under the parallel suite): give the kernel a second to reap it.
    deadline = time.monotonic() + 5
    while any(state(pid) not in ("", "Z") for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [state(pid) for pid in kids] in (["", ""], ["Z", "Z"], ["", "Z"], ["Z", ""])
