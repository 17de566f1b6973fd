"""The build plan (order, tags, args) for given inputs, the build step, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SHA = "0123456789abcdef0123456789abcdef01234567"
ECR = "123456789012.dkr.ecr.us-east-1.amazonaws.com"


@pytest.fixture
def git(tool):
    return tool.GitInfo(sha=SHA, source_url="https://example.invalid/raylift.git")


def test_full_plan_order_tags_and_args(tool, graph, git) -> None:
    plan = tool.make_plan(graph, version="0.1.0", git=git, registry=f"https://{ECR}/")
    assert plan.registry == ECR
    assert [i.name for i in plan.images] == [
        "base-gpu",
        "base-cpu",
        "base-ccl",
        "bnb",
        "ccl",
        "trainer-gpu",
        "trainer-cpu",
        "trainer-ccl",
    ]
    by_name = {i.name: i for i in plan.images}
    trainer = by_name["trainer-gpu"]
    assert trainer.refs == (
        f"{ECR}/raylift/trainer:trainer-gpu-0.1.0-0123456",
        f"{ECR}/raylift/trainer:trainer-gpu-latest",
    )
    assert trainer.build_args == {
        "BASE_IMAGE": f"{ECR}/raylift/bnb:bnb-0.1.0-0123456",
        "DS_ACCELERATOR": "cuda",
        "DS_CUDA_PIP": graph.images["trainer-gpu"].args["DS_CUDA_PIP"],
        "DS_PREBUILD_OPS": "cpu_adam fused_adam async_io pin_memory",
        "LOCK_FILE": "images/trainer/requirements.lock",
        "SOURCE_URL": "https://example.invalid/raylift.git",
        "VCS_REF": SHA,
        "VERSION": "0.1.0",
    }
    assert (
        by_name["trainer-cpu"].build_args["BASE_IMAGE"]
        == f"{ECR}/raylift/base:base-cpu-0.1.0-0123456"
    )
    assert by_name["trainer-ccl"].build_args["BASE_IMAGE"] == f"{ECR}/raylift/ccl:ccl-0.1.0-0123456"
    assert by_name["trainer-ccl"].build_args["LOCK_FILE"] == "images/trainer/requirements-ccl.lock"
    base = by_name["base-gpu"]
    assert "BASE_IMAGE" not in base.build_args
    assert base.build_args["LOCK_FILE"] == "images/base/requirements-gpu.lock"
    assert {by_name[n].build_args["OS_IMAGE"] for n in ("base-gpu", "base-cpu", "base-ccl")} == {
        "debian:bookworm-slim"
    }
    assert by_name["bnb"].build_args["BNB_INSTALL"] == "wheel"


def test_local_plan_has_no_registry_prefix(tool, graph, git) -> None:
    plan = tool.make_plan(graph, version="0.1.0", git=git, only="bnb")
    (bnb,) = plan.images
    assert bnb.refs == ("raylift/bnb:bnb-0.1.0-0123456", "raylift/bnb:bnb-latest")
    assert bnb.build_args["BASE_IMAGE"] == "raylift/base:base-gpu-0.1.0-0123456"


def test_dirty_tree_is_visible_in_the_tag(tool, graph) -> None:
    plan = tool.make_plan(graph, version="0.2.0", git=tool.GitInfo(sha=SHA, dirty=True), only="ccl")
    assert plan.images[0].tags[0] == "ccl-0.2.0-0123456-dirty"


@pytest.mark.parametrize(
    ("only", "variant", "names"),
    [
        ("trainer", None, ["trainer-gpu", "trainer-cpu", "trainer-ccl"]),
        ("trainer", "cpu", ["trainer-cpu"]),
        ("base", "gpu", ["base-gpu"]),
        (None, "gpu", ["base-gpu", "bnb", "trainer-gpu"]),
        (None, "cpu", ["base-cpu", "trainer-cpu"]),
        (None, "ccl", ["base-ccl", "ccl", "trainer-ccl"]),
        ("bnb-never", None, None),
        ("ccl", "gpu", None),
    ],
)
def test_selection(tool, graph, git, only, variant, names) -> None:
    if names is None:
        with pytest.raises(tool.UserError, match="no image matches"):
            tool.make_plan(graph, version="1", git=git, only=only, variant=variant)
        return
    plan = tool.make_plan(graph, version="1", git=git, only=only, variant=variant)
    assert [i.name for i in plan.images] == names


def test_build_arg_overrides_global_layer_and_image(tool, graph, git) -> None:
    plan = tool.make_plan(
        graph,
        version="0.1.0",
        git=git,
        build_args=[
            "PYTHON_VERSION=3.11.9",
            "bnb:BNB_INSTALL=source",
            "trainer:DS_ACCELERATOR=cpu",
            "trainer-gpu:VERSION=custom",
        ],
    )
    by_name = {i.name: i.build_args for i in plan.images}
    assert all(args["PYTHON_VERSION"] == "3.11.9" for args in by_name.values())
    assert by_name["bnb"]["BNB_INSTALL"] == "source"
    assert by_name["trainer-gpu"]["DS_ACCELERATOR"] == "cpu"
    assert by_name["trainer-gpu"]["VERSION"] == "custom"
    assert by_name["trainer-cpu"]["VERSION"] == "0.1.0"


@pytest.mark.parametrize("bad", ["NOEQUALS", "=x", "nope:K=V", "bnb:1BAD=x"])
def test_bad_build_arg(tool, graph, git, bad: str) -> None:
    with pytest.raises(tool.UserError, match="--build-arg"):
        tool.make_plan(graph, version="1", git=git, build_args=[bad])


def test_bad_version_is_refused(tool, graph, git) -> None:
    with pytest.raises(tool.UserError, match="not a valid Docker tag"):
        tool.make_plan(graph, version="1.0+local/x", git=git)


def test_format_plan_lists_everything(tool, graph, git) -> None:
    text = tool.format_plan(tool.make_plan(graph, version="0.1.0", git=git, variant="gpu"))
    lines = text.splitlines()
    assert lines[0].startswith("plan: 3 image(s), version 0.1.0, commit 0123456")
    assert lines[1] == "1. base-gpu  (images/base/Dockerfile)"
    assert "from: raylift/bnb:bnb-0.1.0-0123456" in text
    assert "BNB_COMPUTE_CAPABILITY=86" in text


def test_build_command(tool, graph, git) -> None:
    plan = tool.make_plan(graph, version="0.1.0", git=git, registry=ECR, only="bnb")
    cmd = tool.build_command(plan.images[0], REPO_ROOT)
    assert cmd[:3] == ["docker", "build", "--progress=plain"]
    assert cmd[cmd.index("--file") + 1] == str(REPO_ROOT / "images/bnb/Dockerfile")
    assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--tag"] == list(plan.images[0].refs)
    assert f"BASE_IMAGE={ECR}/raylift/base:base-gpu-0.1.0-0123456" in cmd
    assert cmd[-1] == str(REPO_ROOT)


# ---- the build step, with a stand-in for `docker build`


class FakeDocker:
    """Records `docker build` runs; fails the image named in `fail`."""

    def __init__(self, fail: str | None = None, present: set[str] = frozenset()) -> None:
        self.commands: list[list[str]] = []
        self.fail = fail
        self.present = set(present)
        self.images = self

    def get(self, ref: str):
        if ref not in self.present:
            raise LookupError(ref)
        return ref

    def __call__(self, cmd, env):
        self.commands.append(list(cmd))
        assert env["DOCKER_BUILDKIT"] == "1"
        tag = cmd[cmd.index("--tag") + 1]
        yield "#1 [internal] load build definition from Dockerfile"
        yield "#5 [builder 2/4] RUN uv python install 3.11"
        if self.fail and f":{self.fail}-" in tag:
            yield "#7 [runtime 3/6] RUN pip install -r /opt/raylift/locks/trainer.lock"
            yield "#8 [wheel 2/3] COPY trainer ./trainer"  # a parallel stage, printed later
            yield "#7 0.912 ERROR: No matching distribution found for nope==1"
            yield "#7 ERROR: process did not complete successfully: exit code: 1"
            yield "#8 CANCELED"
            yield "ERROR: failed to solve: process did not complete successfully: exit code: 1"
            yield 1
            return
        yield "#9 naming to docker.io/library/x done"
        yield 0


def test_run_build_in_order(tool, graph, git) -> None:
    plan = tool.make_plan(graph, version="0.1.0", git=git, variant="ccl")
    fake = FakeDocker()
    tool.run_build(plan, REPO_ROOT, fake, runner=fake)
    tags = [c[c.index("--tag") + 1] for c in fake.commands]
    assert tags == [
        "raylift/base:base-ccl-0.1.0-0123456",
        "raylift/ccl:ccl-0.1.0-0123456",
        "raylift/trainer:trainer-ccl-0.1.0-0123456",
    ]


def test_build_failure_names_the_step_and_keeps_the_tail(tool, graph, git) -> None:
    plan = tool.make_plan(graph, version="0.1.0", git=git, variant="ccl")
    fake = FakeDocker(fail="trainer-ccl")
    with pytest.raises(tool.BuildFailed) as err:
        tool.run_build(plan, REPO_ROOT, fake, runner=fake)
    message = str(err.value)
    assert "build of trainer-ccl failed (exit 1)" in message
    assert "[runtime 3/6] RUN pip install" in message
    assert "COPY trainer" not in message
    assert message.endswith(
        ": process did not complete successfully: exit code: 1 (log tail above)"
    )
    assert any("No matching distribution" in line for line in err.value.tail)
    assert len(fake.commands) == 3


def test_only_needs_the_parent_locally(tool, graph, git) -> None:
    plan = tool.make_plan(graph, version="0.1.0", git=git, only="trainer", variant="gpu")
    fake = FakeDocker()
    with pytest.raises(
        tool.UserError, match=r"raylift/bnb:bnb-0\.1\.0-0123456, which is not a local"
    ):
        tool.run_build(plan, REPO_ROOT, fake, runner=fake)
    assert fake.commands == []
    present = FakeDocker(present={"raylift/bnb:bnb-0.1.0-0123456"})
    tool.run_build(plan, REPO_ROOT, present, runner=present)
    assert len(present.commands) == 1


def test_missing_buildx_is_one_clear_line(tool) -> None:
    def no_buildx(cmd, **kwargs):
        assert cmd == ["docker", "buildx", "version"]
        return subprocess.CompletedProcess(cmd, 1, "", "docker: unknown command: docker buildx")

    with pytest.raises(tool.EngineUnavailable, match="no buildx plugin"):
        tool.ensure_buildx(no_buildx)
    tool.ensure_buildx(lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "v0.29.1", ""))


# ---- the CLI, as `make image` runs it


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "image.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        timeout=60,
    )


def test_cli_dry_run_prints_the_plan_without_an_engine() -> None:
    result = _cli(
        "build", "--dry-run", "--git-sha", SHA, "--version", "0.1.0", "--registry", ECR,
        DOCKER_HOST="unix:///nonexistent/docker.sock",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("plan: 8 image(s), version 0.1.0, commit 0123456")
    assert f"{ECR}/raylift/trainer:trainer-cpu-0.1.0-0123456" in result.stdout


def test_cli_plan_defaults_to_pyproject_version_and_head(tool) -> None:
    result = _cli("plan", "--only", "base", "--variant", "cpu")
    if "not a git checkout" in result.stderr:
        pytest.skip("no git commit in this checkout")
    assert result.returncode == 0, result.stderr
    head = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=7", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    version = tool.project_version(REPO_ROOT)
    assert f"plan: 1 image(s), version {version}, commit {head}" in result.stdout


def test_cli_without_engine_is_one_line_and_non_zero() -> None:
    # Neither docker nor buildah on PATH (the CLI runs by its full path).
    result = _cli("build", "--git-sha", SHA, PATH="/nonexistent")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no engine to build with: no `docker` CLI on PATH")
    assert "apt-get install buildah" in lines[0]


def test_cli_user_error_is_one_line_and_debug_shows_the_traceback() -> None:
    result = _cli("plan", "--git-sha", SHA, "--only", "nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        result.stderr.strip()
    ] and result.stderr.startswith("error: no image matches --only nope")
    for argv in (("plan", "--debug"), ("--debug", "plan")):
        debug = _cli(*argv, "--git-sha", SHA, "--only", "nope")
        assert debug.returncode != 0
        assert "Traceback" in debug.stderr, argv
