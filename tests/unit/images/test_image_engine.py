"""The engine seam: which engine `make image` picks, the command lines each one runs, where the
CA bundle and proxies go (never into a build arg), and the build settings' one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tools.imagetool import cli
from tools.imagetool import engine as engines

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def image(tool, graph):
    git = tool.GitInfo(sha="0123456789abcdef0123456789abcdef01234567")
    return tool.make_plan(graph, version="0.1.0", git=git, only="base", variant="cpu").images[0]


def test_auto_picks_docker_where_it_answers_and_buildah_otherwise() -> None:
    chosen, why = engines.select_engine(None, {}, lambda: "", lambda name: None)
    assert chosen.name == "docker" and "BuildKit" in why
    chosen, why = engines.select_engine(
        None, {}, lambda: "no Docker engine answers (x)", lambda name: "/usr/bin/" + name
    )
    assert chosen.name == "buildah" and why.startswith("no Docker engine answers")
    chosen, _ = engines.select_engine(None, {"RAYLIFT_IMAGE_ENGINE": "buildah"}, lambda: "",
                                      lambda name: "/usr/bin/buildah")  # fmt: skip
    assert chosen.name == "buildah"


def test_no_engine_and_a_wrong_choice_are_one_line(tool) -> None:
    with pytest.raises(tool.EngineUnavailable, match="no engine to build with: no `docker` CLI"):
        engines.select_engine("auto", {}, lambda: "no `docker` CLI on PATH", lambda n: None)
    with pytest.raises(tool.EngineUnavailable, match="engine docker: no buildx"):
        engines.select_engine("docker", {}, lambda: "no buildx", lambda n: "/usr/bin/buildah")
    with pytest.raises(tool.UserError, match="pick auto, docker or buildah"):
        engines.select_engine("kaniko", {})


def test_buildah_command_is_daemonless_with_the_ca_as_a_secret(image, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = engines.BuildSettings.from_env(ca, {"HTTPS_PROXY": "http://proxy:3128"})
    cmd = engines.BuildahEngine().build_command(image, REPO_ROOT, settings)
    assert cmd[:8] == ["buildah", "bud", "--isolation", "chroot", "--network", "host",
                       "--layers", "--format"]  # fmt: skip
    assert cmd[cmd.index("--format") + 1] == "docker"  # keeps HEALTHCHECK and SHELL
    assert cmd[cmd.index("--secret") + 1] == f"id=ca,src={ca}"
    assert not [c for c in cmd if "proxy" in c.lower()]  # buildah passes the env through
    assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--tag"] == list(image.refs)
    assert cmd[-1] == str(REPO_ROOT)


def test_docker_command_passes_proxies_as_predefined_args(image, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "169.254.169.254"}
    settings = engines.BuildSettings.from_env(ca, env)
    cmd = engines.DockerEngine().build_command(image, REPO_ROOT, settings)
    args = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--build-arg"]
    assert "HTTPS_PROXY=http://proxy:3128" in args and "NO_PROXY=169.254.169.254" in args
    assert cmd[cmd.index("--secret") + 1] == f"id=ca,src={ca}"
    assert not [a for a in args if str(ca) in a]  # the bundle is never a build arg


def test_ca_bundle_defaults_and_errors(tool, tmp_path: Path) -> None:
    bundle = tmp_path / "corp.pem"
    bundle.write_text("x")
    assert engines.default_ca_bundle({"RAYLIFT_CA_BUNDLE": str(bundle)}) == bundle
    assert engines.default_ca_bundle({"SSL_CERT_FILE": str(bundle)}) == bundle
    with pytest.raises(tool.UserError, match=r"\$SSL_CERT_FILE=.*no such file"):
        engines.default_ca_bundle({"SSL_CERT_FILE": str(tmp_path / "nope.pem")})
    with pytest.raises(tool.UserError, match=r"--ca-bundle .*: no such file"):
        engines.BuildSettings.from_env(tmp_path / "nope.pem", {})


def test_wheelhouse_is_staged_by_link_and_emptied_without_one(tool, tmp_path: Path) -> None:
    house = tmp_path / "house"
    house.mkdir()
    (house / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"w")
    with engines.staged_wheelhouse(tmp_path, house) as staged:
        assert [p.name for p in staged.iterdir()] == [
            "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
        ]
        busy = pytest.raises(tool.UserError, match="another build in this checkout")
        with busy, engines.staged_wheelhouse(tmp_path, None):
            pass
    with engines.staged_wheelhouse(tmp_path, None) as staged:
        assert list(staged.iterdir()) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(tool.UserError, match=r"no \.whl files there"):
        engines.stage_wheelhouse(tmp_path, tmp_path / "empty")


def test_source_settings_become_scoped_build_args(tool) -> None:
    args = argparse.Namespace(
        os_image="localhost/debian:bookworm-slim", index_url="https://mirror/simple",
        torch_index_url="",
    )  # fmt: skip
    assert cli.source_build_args(args) == [
        "base:OS_IMAGE=localhost/debian:bookworm-slim",
        "PIP_INDEX_URL=https://mirror/simple",
        "base:TORCH_INDEX_URL=",
    ]
    args.index_url = "https://user:secret@mirror/simple"
    with pytest.raises(tool.UserError, match="holds credentials") as err:
        cli.source_build_args(args)
    assert "secret" not in str(err.value)


def test_buildah_steps_are_reported_and_a_failure_names_its_step(tool, image) -> None:
    lines = [
        "[1/3] STEP 1/4: FROM localhost/debian:bookworm-slim AS os",
        "[1/3] STEP 2/4: RUN apt-get update",
        "E: Unable to locate package nope",
        'error building at STEP "RUN apt-get update": exit status 100',
        125,
    ]
    steps = []

    def runner(cmd, env):
        yield from lines

    with pytest.raises(tool.BuildFailed) as err:
        tool.build_image(image, REPO_ROOT, runner=runner, on_step=steps.append,
                         engine=engines.BuildahEngine())  # fmt: skip
    assert steps == ["[1/4] FROM localhost/debian:bookworm-slim AS os", "[2/4] RUN apt-get update"]
    assert "build of base-cpu failed (exit 125) at [2/4] RUN apt-get update" in str(err.value)
    assert "exit status 100" in str(err.value)
