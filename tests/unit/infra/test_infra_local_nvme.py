"""The node's instance-store NVMe under stubs: found by its model string in sysfs (EBS volumes
are NVMe devices too), formatted (one device as is, several as RAID 0) and mounted noatime
at /mnt/local_storage for the image's user, then bind-mounted into the container; a node
without any says so and the path stays absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from node_stubs import IMAGE, ScriptRun, fail_first, inner_start_script, node, run_script

from infra.components.userdata import CONTAINER_UID, LOCAL_STORAGE_PATH, render_user_data

EBS = "Amazon Elastic Block Store"
INSTANCE_STORE = "Amazon EC2 NVMe Instance Storage"


def devices(root: Path, models: dict[str, str]) -> None:
    """The node's /sys/block as the kernel shows it: one folder per NVMe namespace."""
    for name, model in models.items():
        folder = root / "sys" / "block" / name / "device"
        folder.mkdir(parents=True)
        folder.joinpath("model").write_text(model + "  \n")  # padded, as NVMe reports it


def boot(tmp_path: Path, models: dict[str, str], **behaviour: str | None) -> ScriptRun:
    devices(tmp_path / "root", models)
    return run_script(render_user_data(node("worker")), tmp_path, behaviour=behaviour or None)


def local_mounts(run: ScriptRun) -> list[list[str]]:
    return [c for c in run.called("mount", "-o") if c[-1] == LOCAL_STORAGE_PATH]


def test_a_node_without_instance_store_says_so_and_leaves_the_path_absent(tmp_path):
    run = boot(tmp_path, {"nvme0n1": EBS})
    assert run.proc.returncode == 0, run.proc.stdout + run.proc.stderr
    assert f"no instance-store NVMe on this node: {LOCAL_STORAGE_PATH} stays absent" in (
        run.proc.stdout
    )
    assert not run.called("mkfs.xfs") and not run.called("mdadm") and not local_mounts(run)
    assert not (run.root / LOCAL_STORAGE_PATH.lstrip("/")).exists()


def test_one_device_is_formatted_xfs_and_mounted_noatime_for_the_image_user(tmp_path):
    run = boot(tmp_path, {"nvme0n1": EBS, "nvme1n1": INSTANCE_STORE})
    assert run.proc.returncode == 0, run.proc.stdout + run.proc.stderr
    # The root volume (EBS) is never touched.
    assert run.called("mkfs.xfs") == [["mkfs.xfs", "-q", "-f", "/dev/nvme1n1"]]
    assert local_mounts(run) == [["mount", "-o", "noatime", "/dev/nvme1n1", LOCAL_STORAGE_PATH]]
    assert not run.called("mdadm")
    where = f"{run.root}{LOCAL_STORAGE_PATH}"
    assert ["chown", f"{CONTAINER_UID}:{CONTAINER_UID}", where] in run.calls
    # Formatted before it was mounted, and the systemd unit started after both.
    order = [c[0] for c in run.calls if c[0] in ("mkfs.xfs", "systemctl")]
    assert order[0] == "mkfs.xfs"
    assert "mounted 1 instance-store NVMe device(s)" in run.proc.stdout


def test_several_devices_become_one_raid0(tmp_path):
    models = {"nvme0n1": EBS, "nvme1n1": INSTANCE_STORE, "nvme2n1": INSTANCE_STORE}
    models["nvme3n1"] = INSTANCE_STORE
    run = boot(tmp_path, models)
    assert run.proc.returncode == 0, run.proc.stdout + run.proc.stderr
    raid = ["--create", "/dev/md0", "--run", "--level=0", "--raid-devices=3"]
    assert run.called("mdadm") == [["mdadm", *raid, "/dev/nvme1n1", "/dev/nvme2n1", "/dev/nvme3n1"]]
    assert run.called("mkfs.xfs") == [["mkfs.xfs", "-q", "-f", "/dev/md0"]]
    assert local_mounts(run) == [["mount", "-o", "noatime", "/dev/md0", LOCAL_STORAGE_PATH]]


def test_a_device_with_a_file_system_is_mounted_not_formatted(tmp_path):
    # A reboot keeps instance store's data: never format over it.
    run = boot(tmp_path, {"nvme1n1": INSTANCE_STORE}, blkid="echo TYPE=xfs")
    assert run.proc.returncode == 0, run.proc.stdout + run.proc.stderr
    assert not run.called("mkfs.xfs")
    assert local_mounts(run) == [["mount", "-o", "noatime", "/dev/nvme1n1", LOCAL_STORAGE_PATH]]


def test_a_device_that_cannot_be_formatted_gets_the_node_replaced(tmp_path):
    run = boot(tmp_path, {"nvme1n1": INSTANCE_STORE}, **fail_first("mkfs.xfs", 999))
    assert run.proc.returncode != 0
    assert f"FAILED: format and mount /dev/nvme1n1 at {LOCAL_STORAGE_PATH}" in run.proc.stdout
    assert run.called("shutdown", "-h", "now")
    assert not run.called("systemctl", "enable")


def _start(tmp_path: Path, local: bool, instance_type: str) -> list[str]:
    root = tmp_path / "root"
    (root / "etc" / "raylift").mkdir(parents=True)
    (root / "etc" / "raylift" / "node.env").write_text(
        f"RAYLIFT_POOL=gpu-spot\nRAYLIFT_INSTANCE_TYPE={instance_type}\n"
    )
    if local:
        (root / "proc").mkdir()
        (root / "proc" / "mounts").write_text(f"/dev/md0 {LOCAL_STORAGE_PATH} xfs rw,noatime 0 0\n")
    script = inner_start_script(render_user_data(node("worker", token_secret_arn=None)))
    run = run_script(script, tmp_path, mounted=True)
    assert run.proc.returncode == 0, run.proc.stderr
    (args,) = run.docker_runs()
    return args


def _values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


@pytest.mark.parametrize("local", [True, False])
def test_the_container_gets_the_local_storage_where_it_is_mounted(tmp_path, local):
    args = _start(tmp_path, local, "g5.12xlarge")
    before = args[: args.index(IMAGE)]
    bind = f"{LOCAL_STORAGE_PATH}:{LOCAL_STORAGE_PATH}"
    assert (bind in _values(before, "-v")) is local
    assert (f"RAYLIFT_LOCAL_STORAGE={LOCAL_STORAGE_PATH}" in _values(before, "-e")) is local


def test_the_node_is_labelled_with_its_instance_type(tmp_path):
    args = _start(tmp_path, False, "g5.12xlarge")
    assert "--labels=market=spot,pool=gpu-spot,instance-type=g5.12xlarge" in args


def test_an_unreadable_instance_type_adds_no_label(tmp_path):
    args = _start(tmp_path, False, "")
    assert "--labels=market=spot,pool=gpu-spot" in args
