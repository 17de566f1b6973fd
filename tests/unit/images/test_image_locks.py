"""Image lock files: consistent with pyproject.toml, and resolvable for the images' platform.

The resolution tests (marker `network`) ask PyPI, through pip's own resolver, whether each
image's chain of locks installs on CPython 3.11 / x86_64 / glibc 2.39, reading metadata
only (PEP 658 files, or HTTP range requests with fast-deps where the index lacks them), so
no multi-GB CUDA wheel is downloaded. What PyPI cannot answer (Intel's index, +cpu local
versions, an sdist whose requirements come from setup.py) is printed at the end of the run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
LOCKS = sorted(REPO_ROOT.glob("images/**/*.lock"))

# Pins of pyproject's `train` extra that an image lock may pin differently, and why.
TRAIN_PIN_EXCEPTIONS = {
    ("images/base/requirements-cpu.lock", "torch"): (
        "oneccl_bind_pt has no release past torch 2.8.0 (torch-ccl end of life)"
    ),
}


def _train_extra_pins() -> dict[str, str]:
    with (REPO_ROOT / "pyproject.toml").open("rb") as fh:
        train = tomllib.load(fh)["project"]["optional-dependencies"]["train"]
    pins = {}
    for requirement in train:
        match = re.match(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?==(\S+)$", requirement.strip())
        assert match, f"pyproject train extra: {requirement!r} is not an exact pin"
        pins[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[3]
    return pins


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_lock_is_exact_pins(tool, lock: Path) -> None:
    pins = tool.read_pins(lock)
    assert pins, f"{lock} is empty"
    keys = [p.key for p in pins]
    assert len(keys) == len(set(keys)), f"{lock} pins a package twice"


def test_every_lock_with_ray_pins_the_project_ray(tool) -> None:
    ray_version = _train_extra_pins()["ray"]
    assert ray_version == "2.60.0"
    found = 0
    for lock in LOCKS:
        for pin in tool.read_pins(lock):
            if pin.key == "ray":
                found += 1
                assert pin.version == ray_version, f"{lock}: {pin} but pyproject has {ray_version}"
                assert {"default", "train"} <= set(pin.extras), f"{lock}: {pin} lacks extras"
    assert found >= 2  # both base variants


def test_image_locks_agree_with_the_train_extra(tool) -> None:
    train = _train_extra_pins()
    for lock in LOCKS:
        rel = str(lock.relative_to(REPO_ROOT))
        for pin in tool.read_pins(lock):
            if pin.key in train and (rel, pin.key) not in TRAIN_PIN_EXCEPTIONS:
                version = pin.version.split("+")[0]
                assert version == train[pin.key], (
                    f"{rel}: {pin} but pyproject's train extra pins {pin.key}=={train[pin.key]}"
                )


def test_gpu_base_uses_the_project_torch(tool, graph) -> None:
    pins = {p.key: p for p in tool.read_pins(REPO_ROOT / graph.images["base-gpu"].lock)}
    assert pins["torch"].version == _train_extra_pins()["torch"]


def test_ccl_binding_matches_its_torch(tool, graph) -> None:
    base = {p.key: p for p in tool.read_pins(REPO_ROOT / graph.images["base-cpu"].lock)}
    ccl = {p.key: p for p in tool.read_pins(REPO_ROOT / graph.images["ccl"].lock)}
    assert ccl["oneccl-bind-pt"].version == base["torch"].version == "2.8.0+cpu"


@pytest.mark.parametrize("name", ["base-gpu", "base-cpu", "bnb", "ccl", "trainer-gpu"])
def test_requirements_inputs_are_in_their_lock(tool, graph, name: str) -> None:
    spec = graph.images[name]
    locks = [REPO_ROOT / graph.images[n].lock for n in tool.chain(graph, name)]
    locked = {p.key: p for lock in locks for p in tool.read_pins(lock)}
    for pin in tool.read_pins(REPO_ROOT / spec.requirements):
        assert pin.key in locked, f"{spec.requirements}: {pin} missing from the locks"
        assert locked[pin.key].version == pin.version, f"{spec.requirements}: {pin} vs lock"


def test_read_pins_refuses_ranges(tool, tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text("# fine\nfoo==1.0\nbar>=2\n")
    with pytest.raises(tool.UserError, match=r"x\.lock:3: 'bar>=2' is not an exact pin"):
        tool.read_pins(lock)


# ---- the check's own logic, with a stand-in for pip (no network)


class FakePip:
    """Writes a pip report installing `install` (name -> version) or fails like pip."""

    def __init__(self, install: dict[str, str], fail: str | None = None) -> None:
        self.install, self.fail, self.calls = install, fail, []
        self.requirements: list[str] = []

    def __call__(self, cmd, env):
        self.calls.append((list(cmd), dict(env)))
        self.requirements = Path(cmd[-1]).read_text().split()
        if self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", self.fail)
        report = Path(cmd[cmd.index("--report") + 1])
        items = [{"metadata": {"name": n, "version": v}} for n, v in self.install.items()]
        report.write_text(json.dumps({"install": items}))
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_resolve_targets_the_image_not_this_machine(tool) -> None:
    fake = FakePip({"foo": "1.0"})
    tool.resolve(["foo==1.0"], python="3.11", glibc="2.39", runner=fake)
    cmd, env = fake.calls[0]
    assert "--dry-run" in cmd and "--only-binary=:all:" in cmd
    assert "--use-feature=fast-deps" in cmd
    platforms = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--platform"]
    assert "manylinux_2_39_x86_64" in platforms and "manylinux_2_40_x86_64" not in platforms
    assert "manylinux2014_x86_64" in platforms
    assert cmd[cmd.index("--python-version") + 1] == "3.11"
    assert env["PIP_CONFIG_FILE"] == "/dev/null"
    assert not {"PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL"} & set(env)


def test_check_reports_packages_missing_from_the_lock(tool, graph) -> None:
    pins = {p.key: p.version for p in tool.read_pins(REPO_ROOT / graph.images["base-gpu"].lock)}
    fake = FakePip({**pins, "surprise": "9.9"})
    report = tool.check_locks(graph, "base-gpu", REPO_ROOT, runner=fake)
    assert [str(p) for p in report.unpinned] == ["surprise==9.9"]


def test_check_ignores_what_the_graph_says_to(tool, graph) -> None:
    pins = {p.key: p.version for p in tool.read_pins(REPO_ROOT / graph.images["base-cpu"].lock)}
    fake = FakePip({**pins, "torch": "2.8.0", "nvidia-cublas-cu12": "12.8.4.1", "triton": "3.4.0"})
    report = tool.check_locks(graph, "base-cpu", REPO_ROOT, runner=fake)
    assert report.unpinned == []
    assert "torch==2.8.0" in fake.requirements and "torch==2.8.0+cpu" not in fake.requirements
    assert "substituted: torch==2.8.0+cpu checked as torch==2.8.0" in report.notes


def test_resolution_failure_is_one_line(tool) -> None:
    fake = FakePip(
        {},
        fail="WARNING: x\nERROR: Cannot install boto3 and python-dateutil==4.0.0\n"
        "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/\n",
    )
    with pytest.raises(tool.UserError) as err:
        tool.resolve(["boto3==1"], python="3.11", glibc="2.39", runner=fake)
    assert "python-dateutil==4.0.0" in str(err.value)
    assert "\n" not in str(err.value)


# ---- the real thing: ask PyPI


@pytest.mark.network
def test_pip_reads_metadata_without_downloading_wheels() -> None:
    # pip 23.2 downloads every wheel in --dry-run when the index serves no PEP 658 metadata
    # (measured here: all 124 wheels of the GPU chain, torch 527 MB and cuDNN 366 MB among
    # them); pip 26.3 with fast-deps reads byte ranges and downloads none.
    import pip

    major = int(pip.__version__.split(".")[0])
    assert major >= 26, f"pip {pip.__version__}: the lock check needs pip>=26 (dev extra)"


@pytest.fixture(scope="session")
def lock_reports(tool, graph, lock_notes):
    """Check every image once, three at a time (pip waits on the network most of the time)."""
    names = list(graph.images)

    def check(name: str):
        try:
            return tool.check_locks(graph, name, REPO_ROOT)
        except tool.UserError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=3) as pool:
        reports = dict(zip(names, pool.map(check, names), strict=True))
    for name, report in reports.items():
        if not isinstance(report, Exception):
            lock_notes.extend(f"{name}: {note}" for note in report.notes)
    return reports


@pytest.mark.network
@pytest.mark.parametrize(
    "name", ["base-gpu", "base-cpu", "bnb", "ccl", "trainer-gpu", "trainer-cpu"]
)
def test_lock_resolves_for_the_image(lock_reports, name: str) -> None:
    report = lock_reports[name]
    if isinstance(report, Exception):
        pytest.fail(str(report))
    assert report.unpinned == [], f"{name}: resolved but not locked: {report.unpinned}"
    sys.stderr.write(f"{name}: {len(report.resolution.pins)} pins resolve\n")


# ---- regenerating locks (`tools/image.py lock`), with a stand-in resolver


class EchoPip:
    """Resolves every requirement to its pin (or the constraint's, or 1.0) plus `common`."""

    def __call__(self, cmd, env):
        def lines(path: str) -> list[str]:
            return [ln for ln in Path(path).read_text().split("\n") if ln.strip()]

        constraints = {}
        if "-c" in cmd:
            for line in lines(cmd[cmd.index("-c") + 1]):
                name, _, version = line.partition("==")
                constraints[name.lower()] = version
        items = [{"metadata": {"name": "common", "version": "2.0"}}]
        for line in lines(cmd[-1]):
            match = re.match(r"^([A-Za-z0-9._-]+)(?:\[([^\]]+)\])?(?:==(\S+))?", line)
            name, extras, version = match[1], match[2], match[3]
            item = {
                "metadata": {
                    "name": name,
                    "version": version or constraints.get(name.lower(), "1.0"),
                }
            }
            if extras:
                item["requested_extras"] = extras.split(",")
            items.append(item)
        Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps({"install": items}))
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_write_locks_layers_pins_by_image(tool, tmp_path: Path, monkeypatch) -> None:
    import shutil

    shutil.copytree(REPO_ROOT / "images", tmp_path / "images")
    graph = tool.load_graph(tmp_path / "images" / "graph.yaml", tmp_path)
    monkeypatch.setattr(
        tool, "sdist_requires", lambda name, version, check: ("einops", *check.plus)
    )
    written = tool.write_locks(graph, tmp_path, list(graph.images), runner=EchoPip())
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "images/base/requirements-gpu.lock",
        "images/base/requirements-cpu.lock",
        "images/bnb/requirements.lock",
        "images/ccl/requirements.lock",
        "images/trainer/requirements.lock",
    }

    def pins(rel: str) -> set[str]:
        return {str(p) for p in tool.read_pins(tmp_path / rel)}

    assert pins("images/base/requirements-gpu.lock") == {
        "common==2.0",
        "ray[default,train]==2.60.0",
        "torch==2.13.0",
    }
    # The +cpu pin comes back as written, not as its PyPI stand-in.
    assert "torch==2.8.0+cpu" in pins("images/base/requirements-cpu.lock")
    assert pins("images/bnb/requirements.lock") == {"bitsandbytes==0.50.2"}
    assert pins("images/ccl/requirements.lock") == {"oneccl_bind_pt==2.8.0+cpu"}
    trainer = pins("images/trainer/requirements.lock")
    assert {"deepspeed==0.19.8", "einops==1.0", "nvidia-ml-py==1.0", "boto3==1.44.5"} <= trainer
    assert "common==2.0" not in trainer  # already in base
    header = (tmp_path / "images/trainer/requirements.lock").read_text().splitlines()[0]
    assert "trainer-gpu, trainer-cpu" in header
