"""Image lock files: consistent with pyproject.toml, and resolvable for the images' platform.

The resolution tests (marker `network`) ask PyPI, through `uv pip compile`, whether each
image's chain of locks installs on CPython 3.11 / x86_64 / glibc 2.39, reading metadata
only (PEP 658 files, or HTTP range requests where the index lacks them), so no multi-GB
CUDA wheel is downloaded. What PyPI cannot answer (Intel's index, +cpu local versions, an
sdist whose requirements come from setup.py) is printed at the end of the run.
"""

from __future__ import annotations

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
    ("images/base/requirements-ccl.lock", "torch"): (
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


def test_cpu_base_uses_the_project_torch_as_a_cpu_wheel(tool, graph) -> None:
    pins = {p.key: p for p in tool.read_pins(REPO_ROOT / graph.images["base-cpu"].lock)}
    assert pins["torch"].version == _train_extra_pins()["torch"] + "+cpu"
    assert not [key for key in pins if key.startswith(("nvidia-", "cuda-", "triton"))]


def test_ccl_binding_matches_its_torch(tool, graph) -> None:
    base = {p.key: p for p in tool.read_pins(REPO_ROOT / graph.images["base-ccl"].lock)}
    ccl = {p.key: p for p in tool.read_pins(REPO_ROOT / graph.images["ccl"].lock)}
    assert ccl["oneccl-bind-pt"].version == base["torch"].version == "2.8.0+cpu"


@pytest.mark.parametrize(
    "name",
    ["base-gpu", "base-cpu", "base-ccl", "bnb", "ccl", "trainer-gpu", "trainer-cpu", "trainer-ccl"],
)
def test_requirements_inputs_are_in_their_lock(tool, graph, name: str) -> None:
    spec = graph.images[name]
    locks = [REPO_ROOT / graph.images[n].lock for n in tool.chain(graph, name)]
    locked = {p.key: p for lock in locks for p in tool.read_pins(lock)}
    for pin in tool.read_pins(REPO_ROOT / spec.requirements):
        assert pin.key in locked, f"{spec.requirements}: {pin} missing from the locks"
        assert locked[pin.key].version == pin.version, f"{spec.requirements}: {pin} vs lock"


def test_trainer_ccl_takes_the_trainer_pins_less_torchao(tool, graph) -> None:
    """torchao 0.18 (QLoRA under FSDP2) needs torch >= 2.11 and its wheel does not declare
    torch, so pip would put it beside ccl's torch 2.8 unnoticed: ccl has an input of its own,
    which must stay the trainer's otherwise."""
    trainer, ccl = graph.images["trainer-cpu"], graph.images["trainer-ccl"]
    assert graph.images["trainer-gpu"].lock == trainer.lock != ccl.lock
    main = {str(p) for p in tool.read_pins(REPO_ROOT / trainer.requirements)}
    other = {str(p) for p in tool.read_pins(REPO_ROOT / ccl.requirements)}
    assert main - other == {f"torchao=={_train_extra_pins()['torchao']}"}
    assert other <= main
    assert "torchao" in {p.key for p in tool.read_pins(REPO_ROOT / trainer.lock)}
    assert "torchao" not in {p.key for p in tool.read_pins(REPO_ROOT / ccl.lock)}
    base = {p.key: p.version for p in tool.read_pins(REPO_ROOT / graph.images["base-ccl"].lock)}
    assert base["torch"].startswith("2.8.")


def test_read_pins_refuses_ranges(tool, tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text("# fine\nfoo==1.0\nbar>=2\n")
    with pytest.raises(tool.UserError, match=r"x\.lock:3: 'bar>=2' is not an exact pin"):
        tool.read_pins(lock)


# ---- the check's own logic, with a stand-in for uv (no network)


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


class FakeUv:
    """Answers `uv pip compile` with `install` (name -> version), as uv writes it, or fails
    like uv."""

    def __init__(self, install: dict[str, str], fail: str | None = None) -> None:
        self.install, self.fail, self.calls = install, fail, []
        self.requirements: list[str] = []

    def __call__(self, cmd, env):
        self.calls.append((list(cmd), dict(env)))
        self.requirements = Path(cmd[-1]).read_text().split()
        if self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", self.fail)
        lines = [f"{n}=={v}" for n, v in sorted(self.install.items())]
        Path(_arg(cmd, "--output-file")).write_text("\n".join(lines) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_resolve_targets_the_image_not_this_machine(tool, monkeypatch) -> None:
    for var in ("UV_INDEX_URL", "UV_FIND_LINKS", "UV_CONSTRAINT", "UV_EXTRA_INDEX_URL"):
        monkeypatch.setenv(var, "file:///somewhere/local")
    fake = FakeUv({"foo": "1.0"})
    tool.resolve(["foo==1.0"], python="3.11", glibc="2.39", runner=fake)
    cmd, env = fake.calls[0]
    assert cmd[1:3] == ["pip", "compile"]
    assert _arg(cmd, "--python-platform") == "x86_64-manylinux_2_39"
    assert _arg(cmd, "--python-version") == "3.11"
    assert _arg(cmd, "--only-binary") == ":all:"
    assert "--no-config" in cmd
    # The index (a mirror) stays; this machine's find-links, constraints and extra indexes go.
    assert env["UV_INDEX_URL"] == "file:///somewhere/local"
    assert not {"UV_FIND_LINKS", "UV_CONSTRAINT", "UV_EXTRA_INDEX_URL"} & set(env)


def test_resolve_refuses_a_glibc_uv_cannot_target(tool) -> None:
    with pytest.raises(tool.UserError, match=r"glibc 2\.12: uv resolves for manylinux 2\.17"):
        tool.resolve(["foo==1.0"], python="3.11", glibc="2.12", runner=FakeUv({}))


def test_resolve_keeps_the_extras_a_requirement_asked_for(tool) -> None:
    # uv writes `ray==2.60.0`; the lock must still say which extras the image installs.
    fake = FakeUv({"ray": "2.60.0", "aiohttp": "3.14.5"})
    resolution = tool.resolve(
        ["ray[train,default]==2.60.0"], python="3.11", glibc="2.39", runner=fake
    )
    assert str(resolution.pins["ray"]) == "ray[default,train]==2.60.0"
    assert str(resolution.pins["aiohttp"]) == "aiohttp==3.14.5"


def test_check_reports_packages_missing_from_the_lock(tool, graph) -> None:
    pins = {p.key: p.version for p in tool.read_pins(REPO_ROOT / graph.images["base-gpu"].lock)}
    fake = FakeUv({**pins, "surprise": "9.9"})
    report = tool.check_locks(graph, "base-gpu", REPO_ROOT, runner=fake)
    assert [str(p) for p in report.unpinned] == ["surprise==9.9"]


def test_check_ignores_what_the_graph_says_to(tool, graph) -> None:
    pins = {p.key: p.version for p in tool.read_pins(REPO_ROOT / graph.images["base-ccl"].lock)}
    fake = FakeUv({**pins, "torch": "2.8.0", "nvidia-cublas-cu12": "12.8.4.1", "triton": "3.4.0"})
    report = tool.check_locks(graph, "base-ccl", REPO_ROOT, runner=fake)
    assert report.unpinned == []
    assert "torch==2.8.0" in fake.requirements and "torch==2.8.0+cpu" not in fake.requirements
    assert "substituted: torch==2.8.0+cpu checked as torch==2.8.0" in report.notes


def test_resolution_failure_is_one_line(tool) -> None:
    fake = FakeUv(
        {},
        fail="error: No solution found when resolving dependencies\n"
        "  cause: Because boto3==1.40.0 depends on botocore>=1.40.0,<1.41.0 and you require\n"
        "         botocore==1.30.0, we can conclude that your requirements are unsatisfiable.\n",
    )
    with pytest.raises(tool.UserError) as err:
        tool.resolve(["boto3==1.40.0"], python="3.11", glibc="2.39", runner=fake)
    assert "uv cannot resolve these pins for cp311/glibc 2.39: No solution found" in str(err.value)
    assert "botocore==1.30.0" in str(err.value)
    assert "\n" not in str(err.value)


# ---- the real thing: ask PyPI


@pytest.fixture(scope="session")
def uv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache of the session's own, so what the resolution fetched can be measured."""
    return tmp_path_factory.mktemp("uv-cache")


@pytest.fixture(scope="session")
def lock_reports(tool, graph, lock_notes, uv_cache):
    """Check every image once, three at a time (uv waits on the network most of the time),
    the longest chains first: they hold the sdist fetch, which the others can overlap."""
    names = sorted(graph.images, key=lambda n: -len(tool.chain(graph, n)))
    patch = pytest.MonkeyPatch()
    patch.setenv("UV_CACHE_DIR", str(uv_cache))

    def check(name: str):
        try:
            return tool.check_locks(graph, name, REPO_ROOT)
        except tool.UserError as exc:
            return exc

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            reports = dict(zip(names, pool.map(check, names), strict=True))
    finally:
        patch.undo()
    for name, report in reports.items():
        if not isinstance(report, Exception):
            lock_notes.extend(f"{name}: {note}" for note in report.notes)
    return reports


@pytest.mark.network
@pytest.mark.parametrize(
    "name",
    ["base-gpu", "base-cpu", "base-ccl", "bnb", "ccl", "trainer-gpu", "trainer-cpu", "trainer-ccl"],
)
def test_lock_resolves_for_the_image(lock_reports, name: str) -> None:
    report = lock_reports[name]
    if isinstance(report, Exception):
        pytest.fail(str(report))
    assert report.unpinned == [], f"{name}: resolved but not locked: {report.unpinned}"
    sys.stderr.write(f"{name}: {len(report.resolution.pins)} pins resolve\n")


@pytest.mark.network
def test_resolution_reads_metadata_not_wheels(lock_reports, uv_cache: Path) -> None:
    # The GPU chain alone is 124 wheels (torch 527 MB, cuDNN 366 MB): resolving must read only
    # their metadata. uv unpacks every wheel it downloads into the cache's archive folder and
    # keeps metadata it read under wheels-v*, so the cache tells which it did.
    assert not any(isinstance(r, Exception) for r in lock_reports.values())
    unpacked = [p.name for p in uv_cache.glob("archive-v*/*")]
    assert unpacked == [], f"uv downloaded and unpacked wheels: {unpacked[:5]}"
    metadata = [p for p in uv_cache.glob("wheels-v*/**/*") if p.is_file()]
    assert metadata, "uv read no wheel metadata: is UV_CACHE_DIR honoured?"
    assert sum(p.stat().st_size for p in metadata) < 20 * 2**20


# ---- regenerating locks (`tools/image.py lock`), with a stand-in resolver


class EchoUv:
    """Resolves every requirement to its pin (or the constraint's, or 1.0) plus `common`, and
    writes them as uv does: name==version, extras dropped."""

    def __call__(self, cmd, env):
        def lines(path: str) -> list[str]:
            return [ln for ln in Path(path).read_text().split("\n") if ln.strip()]

        constraints = {}
        if "--constraint" in cmd:
            for line in lines(_arg(cmd, "--constraint")):
                name, _, version = line.partition("==")
                constraints[name.lower()] = version
        out = ["common==2.0"]
        for line in lines(cmd[-1]):
            match = re.match(r"^([A-Za-z0-9._-]+)(?:\[[^\]]+\])?(?:==(\S+))?", line)
            name, version = match[1], match[2]
            out.append(f"{name}=={version or constraints.get(name.lower(), '1.0')}")
        Path(_arg(cmd, "--output-file")).write_text("\n".join(out) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_write_locks_layers_pins_by_image(tool, tmp_path: Path, monkeypatch) -> None:
    import shutil

    shutil.copytree(REPO_ROOT / "images", tmp_path / "images")
    graph = tool.load_graph(tmp_path / "images" / "graph.yaml", tmp_path)
    from tools.imagetool import locks

    monkeypatch.setattr(
        locks, "sdist_requires", lambda name, version, check: ("einops", *check.plus)
    )
    written = tool.write_locks(graph, tmp_path, list(graph.images), runner=EchoUv())
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "images/base/requirements-gpu.lock",
        "images/base/requirements-cpu.lock",
        "images/base/requirements-ccl.lock",
        "images/bnb/requirements.lock",
        "images/ccl/requirements.lock",
        "images/trainer/requirements.lock",
        "images/trainer/requirements-ccl.lock",
    }

    def pins(rel: str) -> set[str]:
        return {str(p) for p in tool.read_pins(tmp_path / rel)}

    assert pins("images/base/requirements-gpu.lock") == {
        "common==2.0",
        "ray[default,train]==2.60.0",
        "torch==2.13.0",
    }
    # The +cpu pin comes back as written, not as its PyPI stand-in.
    assert "torch==2.13.0+cpu" in pins("images/base/requirements-cpu.lock")
    assert "torch==2.8.0+cpu" in pins("images/base/requirements-ccl.lock")
    assert pins("images/bnb/requirements.lock") == {"bitsandbytes==0.50.2", "liger-kernel==0.8.5"}
    assert pins("images/ccl/requirements.lock") == {"oneccl_bind_pt==2.8.0+cpu"}
    trainer = pins("images/trainer/requirements.lock")
    assert {"deepspeed==0.19.8", "einops==1.0", "nvidia-ml-py==1.0", "boto3==1.44.5"} <= trainer
    assert "common==2.0" not in trainer  # already in base
    header = (tmp_path / "images/trainer/requirements.lock").read_text().splitlines()[0]
    assert "for trainer-gpu, trainer-cpu;" in header
    ccl = pins("images/trainer/requirements-ccl.lock")
    assert "torchao==0.18.0" in trainer and not any(p.startswith("torchao") for p in ccl)


class IndexUv:
    """uv against a tiny index: every requirement at its pin, its dependencies (`deps`) at a
    pin or constraint where there is one and at the index's newest version otherwise; a pin
    that contradicts another pin or a constraint fails as uv does. Records each call's
    requirements."""

    def __init__(self, newest: dict[str, str], deps: dict[str, list[str]]) -> None:
        self.newest, self.deps = newest, deps
        self.inputs: list[list[str]] = []

    def __call__(self, cmd, env):
        def pins(path: str) -> list[tuple[str, str | None]]:
            found = []
            for line in Path(path).read_text().split("\n"):
                match = re.match(r"^([A-Za-z0-9._-]+)(?:\[[^\]]+\])?(?:==(\S+))?", line.strip())
                if match:
                    found.append((re.sub(r"[-_.]+", "-", match[1]).lower(), match[2]))
            return found

        constraints = dict(pins(_arg(cmd, "--constraint"))) if "--constraint" in cmd else {}
        requested = pins(cmd[-1])
        self.inputs.append([f"{n}=={v}" if v else n for n, v in requested])
        chosen: dict[str, str] = {}
        for name, version in requested:
            for other in (chosen.get(name), constraints.get(name)):
                if version and other and other != version:
                    return subprocess.CompletedProcess(
                        cmd, 1, "", f"error: No solution found: {name}=={version} vs {other}"
                    )
            if version:
                chosen[name] = version
        todo = [name for name, _ in requested]
        while todo:
            name = todo.pop()
            if name not in chosen:
                chosen[name] = constraints.get(name) or self.newest.get(name, "1.0")
            todo += [d for d in self.deps.get(name, []) if d not in chosen]
        lines = [f"{n}=={v}" for n, v in sorted(chosen.items())]
        Path(_arg(cmd, "--output-file")).write_text("\n".join(lines) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_a_child_lock_keeps_the_versions_its_parents_locked(tool, tmp_path: Path, monkeypatch):
    """`lock --only trainer-cpu`: base-cpu's image is built from its lock (virtualenv 21.15.8,
    through ray), while the index now has a newer virtualenv. The trainer's lock must be
    resolved around what base installs, not around base's requirements input resolved anew
    (which picks the newest virtualenv and then contradicts base's lock)."""
    import shutil

    from tools.imagetool import locks

    shutil.copytree(REPO_ROOT / "images", tmp_path / "images")
    graph = tool.load_graph(tmp_path / "images" / "graph.yaml", tmp_path)
    base_lock = tmp_path / graph.images["base-cpu"].lock
    before = base_lock.read_text()
    locked = {p.key: p.version for p in tool.read_pins(base_lock)}
    assert locked["virtualenv"] == "21.15.8"
    monkeypatch.setattr(locks, "sdist_requires", lambda name, version, check: ("einops",))
    uv = IndexUv(newest={"virtualenv": "21.15.11"}, deps={"ray": ["virtualenv"]})

    written = tool.write_locks(graph, tmp_path, ["trainer-cpu"], runner=uv)

    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        graph.images["trainer-cpu"].lock
    ]
    assert base_lock.read_text() == before  # a parent is never rewritten by its child
    # The chain's answer was computed with base's locked pins, so it kept base's virtualenv.
    assert "virtualenv==21.15.8" in uv.inputs[0]
    trainer = {
        p.key: p.version for p in tool.read_pins(tmp_path / graph.images["trainer-cpu"].lock)
    }
    assert "virtualenv" not in trainer and trainer["deepspeed"] == "0.19.8"
    # trainer-gpu shares the file: it is regenerated too, so the file still holds both.
    header = (tmp_path / graph.images["trainer-cpu"].lock).read_text().splitlines()[0]
    assert "trainer-gpu, trainer-cpu" in header
