"""CPU, memory, OS and disk facts from the Linux system files."""

from __future__ import annotations

from controller.stages.probe import parse_outputs
from tests.unit.probe.helpers import machine


def test_cpuinfo_counts_physical_cores_across_sockets_and_reads_avx() -> None:
    profile = parse_outputs({"cpuinfo": machine("cpu-only-no-driver")["cpuinfo"]})
    cpu = profile.cpu
    assert cpu.model == "Intel(R) Xeon(R) CPU E5-2680 v4 @ 2.40GHz"
    assert (cpu.cores, cpu.threads) == (28, 56)  # 2 sockets x 14 cores, hyper-threaded
    assert cpu.avx2 is True and cpu.avx512 is False
    assert "fma" in cpu.flags and "f16c" in cpu.flags and "bmi2" in cpu.flags


def test_avx512_means_avx512f() -> None:
    profile = parse_outputs({"cpuinfo": machine("single-v100-32g-table-only")["cpuinfo"]})
    assert profile.cpu.avx512 is True
    only_vl = "processor\t: 0\nmodel name\t: Odd CPU\nflags\t\t: avx2 avx512vl\n"
    assert parse_outputs({"cpuinfo": only_vl}).cpu.avx512 is False


def test_arm_cpuinfo_takes_the_model_from_lscpu() -> None:
    cpuinfo = "".join(f"processor\t: {n}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes crc32 atomics\n"
                      f"CPU implementer\t: 0x41\nCPU part\t: 0xd0c\n\n" for n in range(4))
    lscpu = ("Architecture:        aarch64\nCPU(s):              4\nModel name:          Neoverse-N1\n"
             "Thread(s) per core:  1\nCore(s) per cluster: 4\nCluster(s):          1\n")
    profile = parse_outputs({"cpuinfo": cpuinfo, "lscpu.txt": lscpu})
    assert profile.cpu.model == "Neoverse-N1"
    assert (profile.cpu.cores, profile.cpu.threads) == (4, 4)  # no physical/core ids: lscpu's count
    assert profile.cpu.flags[:2] == ["fp", "asimd"]
    assert profile.cpu.avx2 is False


def test_lscpu_alone_and_nproc_alone() -> None:
    outputs = machine("single-v100-16g-linux")
    profile = parse_outputs({"lscpu.txt": outputs["lscpu.txt"]})
    assert (profile.cpu.model, profile.cpu.cores, profile.cpu.threads) == ("AMD Ryzen 5 5600X 6-Core Processor", 6, 12)
    assert profile.cpu.avx2 is True
    assert parse_outputs({"nproc": "24\n"}).cpu.threads == 24
    bad = parse_outputs({"nproc": "nproc: command not found\n"})
    assert bad.cpu.threads is None
    assert bad.warnings == ["nproc line 1: 'nproc: command not found' is not a processor count"]


def test_meminfo_in_mib() -> None:
    assert parse_outputs({"meminfo": machine("twelve-v100-threadripper")["meminfo"]}).memory_mib == 263776312 // 1024
    broken = parse_outputs({"meminfo": "MemTotal: lots\n"})
    assert broken.memory_mib is None
    assert broken.warnings == ["meminfo line 1: MemTotal 'lots' is not a size in kB"]


def test_os_release_name_and_version() -> None:
    profile = parse_outputs({"os-release": machine("cpu-only-no-driver")["os-release"]})
    assert (profile.os.family, profile.os.name, profile.os.version, profile.os.wsl) == (
        "linux", "Debian GNU/Linux", "12", False)
    odd = parse_outputs({"os-release": "NAME=Arch Linux\nthis line is junk\nBUILD_ID=rolling\n"})
    assert odd.os.name == "Arch Linux" and odd.os.version is None
    assert odd.warnings == ["os-release line 2: not a KEY=value line: 'this line is junk'"]


def test_wsl_kernel_in_proc_version() -> None:
    outputs = machine("wsl2-v100-16g")
    profile = parse_outputs({"proc-version": outputs["proc-version"], "os-release": outputs["os-release"]})
    assert profile.os.wsl is True and profile.os.family == "linux"
    native = parse_outputs({"proc-version": machine("single-v100-16g-linux")["proc-version"]})
    assert native.os.wsl is False and native.os.family == "linux"


def test_df_row_becomes_the_model_dir_disk() -> None:
    profile = parse_outputs({"df.txt": machine("twelve-v100-threadripper")["df.txt"]}, model_dir="/srv/models")
    assert len(profile.disks) == 1
    disk = profile.disks[0]
    assert (disk.path, disk.filesystem) == ("/srv/models", "/dev/nvme1n1p1")
    assert (disk.total_mib, disk.free_mib) == (3844550452 // 1024, 2445898132 // 1024)
    without = parse_outputs({"df.txt": machine("twelve-v100-threadripper")["df.txt"]})
    assert without.disks[0].path == "/srv"  # no model dir given: the mount point


def test_df_mount_point_with_spaces_and_a_junk_line() -> None:
    text = ("Filesystem     1024-blocks    Used Available Capacity Mounted on\n"
            "/dev/sdb1        976762584 1048576 975714008       1% /mnt/big disk\n"
            "df: /nope: No such file or directory\n")
    profile = parse_outputs({"df.txt": text})
    assert profile.disks[0].path == "/mnt/big disk"
    assert profile.warnings == ["df.txt line 3: not a df -P row: 'df: /nope: No such file or directory'"]
