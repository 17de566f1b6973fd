"""images/graph.yaml: valid, acyclic, every base exists, and it agrees with the Dockerfiles."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_real_graph_loads(graph) -> None:
    assert set(graph.images) == {
        *("base-gpu", "base-cpu", "base-ccl", "bnb", "ccl"),
        *("trainer-gpu", "trainer-cpu", "trainer-ccl"),
    }


def test_repos_match_infra_ecr_names(graph) -> None:
    # infra/ creates exactly these ECR repositories; the build tool never creates any.
    repos = {spec.layer: spec.repo for spec in graph.images.values()}
    assert repos == {
        "base": "raylift/base",
        "bnb": "raylift/bnb",
        "ccl": "raylift/ccl",
        "trainer": "raylift/trainer",
    }


def test_chains(tool, graph) -> None:
    assert tool.chain(graph, "trainer-gpu") == ["base-gpu", "bnb", "trainer-gpu"]
    assert tool.chain(graph, "trainer-cpu") == ["base-cpu", "trainer-cpu"]
    assert tool.chain(graph, "trainer-ccl") == ["base-ccl", "ccl", "trainer-ccl"]


def test_order_puts_parents_first(tool, graph) -> None:
    order = tool.build_order(graph)
    assert order == [
        *("base-gpu", "base-cpu", "base-ccl", "bnb", "ccl"),
        *("trainer-gpu", "trainer-cpu", "trainer-ccl"),
    ]
    for name, spec in graph.images.items():
        if spec.base:
            assert order.index(spec.base) < order.index(name)


def test_children_declare_base_image_and_every_image_its_labels(tool, graph) -> None:
    for spec in graph.images.values():
        declared = tool.dockerfile_args(REPO_ROOT / spec.dockerfile)
        assert {"LOCK_FILE", "VERSION", "VCS_REF", "SOURCE_URL"} <= declared, spec.dockerfile
        if spec.base:
            assert "BASE_IMAGE" in declared, spec.dockerfile


def test_every_image_is_debian_12_and_gpu_gets_cuda_from_wheels(graph) -> None:
    # Debian 12 with its own Python 3.11: what is built on a machine without Docker Hub
    # (mmdebstrap) is the same OS as what ships. torch's wheels carry CUDA 13 (cudart,
    # cuBLAS, cuDNN, NCCL), so the GPU base needs no CUDA image, only the toolkit's env.
    for name in ("base-gpu", "base-cpu", "base-ccl"):
        assert graph.images[name].args["OS_IMAGE"] == "debian:bookworm-slim"
    assert graph.glibc == "2.36"
    text = (REPO_ROOT / "images/base/Dockerfile").read_text()
    assert "ARG OS_IMAGE=debian:bookworm-slim" in text
    assert (
        "NVIDIA_VISIBLE_DEVICES=all" in text
        and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text
    )
    assert "nvidia/cuda" not in text


# ---- invalid graphs: each must fail with one line that names the problem


@pytest.fixture
def graph_copy(tmp_path: Path):
    """A writable copy of the repo's images/ so a test can break one thing at a time."""
    shutil.copytree(REPO_ROOT / "images", tmp_path / "images")
    path = tmp_path / "images" / "graph.yaml"
    data = yaml.safe_load(path.read_text())

    def write(mutate) -> Path:
        mutate(data)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return tmp_path, write


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["images"]["bnb"].update(base="nope"), "images.bnb.base: 'nope' is not"),
        (
            lambda d: d["images"]["base-gpu"].update(base="trainer-gpu"),
            "images form a cycle",
        ),
        (lambda d: d["images"]["ccl"].update(base="base-gpu"), "is a gpu image but 'ccl' is ccl"),
        (
            lambda d: d["images"]["bnb"].update(dockerfile="images/bnb/Nope"),
            "images.bnb.dockerfile: images/bnb/Nope does not exist",
        ),
        (
            lambda d: d["images"]["bnb"]["args"].update(BNB_INSTAL="source"),
            "declares no ARG BNB_INSTAL",
        ),
        (lambda d: d["images"]["bnb"].update(colour="blue"), "images.bnb.colour: Extra inputs"),
        (lambda d: d["images"]["bnb"].update(variant="tpu"), "images.bnb.variant"),
        (lambda d: d["images"]["bnb"].update(repo="Raylift/BNB"), "images.bnb.repo"),
        (lambda d: d.update(images={}), "images: is empty"),
        (lambda d: d["images"].update({"Bad_Name": d["images"]["bnb"]}), "name must match"),
    ],
)
def test_invalid_graph_is_one_clear_line(tool, graph_copy, mutate, message: str) -> None:
    root, write = graph_copy
    path = write(mutate)
    with pytest.raises(tool.UserError) as err:
        tool.load_graph(path, root)
    text = str(err.value)
    assert message in text
    assert "\n" not in text
    assert text.startswith(str(path))


def test_yaml_error_names_the_line(tool, tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text("schema: 1\nimages:\n  base: [unclosed\n")
    with pytest.raises(tool.UserError, match=r"graph\.yaml:\d+: not valid YAML"):
        tool.load_graph(path, tmp_path)


def test_missing_graph(tool, tmp_path: Path) -> None:
    with pytest.raises(tool.UserError, match="graph file not found"):
        tool.load_graph(tmp_path / "nope.yaml", tmp_path)
