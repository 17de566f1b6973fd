"""Real builds through the engine `make image` picks (Docker BuildKit, else buildah).

The first test builds a two-image graph made of `FROM scratch` images (no registry access,
a few seconds) through the same code path as `make image`: build order, BASE_IMAGE chaining,
tags and OCI labels are then read back from the engine. The full graph builds only with
RAYLIFT_FULL_IMAGE_BUILD=1: it downloads CUDA images and several GB of wheels.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.docker


def ref_exists(engine, ref: str) -> bool:
    return engine.exists(ref)


TINY_GRAPH = """\
schema: 1
python: "3.11"
glibc: "2.39"
context: .
images:
  parent:
    layer: parent
    variant: cpu
    repo: raylift-test/parent
    dockerfile: parent/Dockerfile
    requirements: parent/requirements.in
    lock: parent/requirements.lock
    args:
      GREETING: hello
  child:
    layer: child
    variant: cpu
    repo: raylift-test/child
    base: parent
    dockerfile: child/Dockerfile
    requirements: child/requirements.in
    lock: child/requirements.lock
"""

PARENT = """\
# syntax=docker/dockerfile:1
FROM scratch
ARG GREETING=unset
ARG LOCK_FILE
ARG VERSION=dev
ARG VCS_REF=unknown
ARG SOURCE_URL=unknown
LABEL org.opencontainers.image.version="${VERSION}" \\
      org.opencontainers.image.revision="${VCS_REF}" \\
      test.greeting="${GREETING}"
COPY ${LOCK_FILE} /parent.lock
"""

CHILD = """\
# syntax=docker/dockerfile:1
ARG BASE_IMAGE=missing
FROM ${BASE_IMAGE}
ARG LOCK_FILE
ARG VERSION=dev
ARG VCS_REF=unknown
ARG SOURCE_URL=unknown
LABEL org.opencontainers.image.version="${VERSION}"
COPY ${LOCK_FILE} /child.lock
"""


@pytest.fixture(scope="module")
def engine(tool):
    from tools.imagetool.engine import select_engine

    try:
        chosen, _ = select_engine()
    except tool.EngineUnavailable as exc:
        if os.environ.get("RAYLIFT_REQUIRE_IMAGE_ENGINE"):
            raise
        pytest.skip(f"no engine (Docker BuildKit or buildah): {exc}")
    return chosen


def build(tool, plan, root, engine):
    return tool.run_build(plan, root, tool.build.EngineImages(engine), engine=engine)


def test_tiny_graph_builds_in_order_with_tags_and_labels(tool, engine, tmp_path: Path) -> None:
    for name, text in (("parent", PARENT), ("child", CHILD)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "Dockerfile").write_text(text)
        (tmp_path / name / "requirements.in").write_text("")
        (tmp_path / name / "requirements.lock").write_text(f"# {name}\n")
    (tmp_path / "graph.yaml").write_text(TINY_GRAPH)
    graph = tool.load_graph(tmp_path / "graph.yaml", tmp_path)
    git = tool.GitInfo(sha="feedfacefeedfacefeedfacefeedfacefeedface")
    plan = tool.make_plan(graph, version="9.9.9", git=git)
    try:
        build(tool, plan, tmp_path, engine)
        parent = engine.labels("raylift-test/parent:parent-9.9.9-feedfac")
        child = engine.labels("raylift-test/child:child-9.9.9-feedfac")
        assert engine.exists("raylift-test/child:child-latest")
        assert parent["test.greeting"] == "hello"
        assert parent["org.opencontainers.image.revision"] == git.sha
        assert child["org.opencontainers.image.version"] == "9.9.9"
        assert child["test.greeting"] == "hello"  # inherited: built FROM the parent
    finally:
        for image in plan.images:
            for ref in image.refs:
                with contextlib.suppress(Exception):
                    engine.remove(ref)


def test_failing_build_reports_the_step(tool, engine, tmp_path: Path) -> None:
    (tmp_path / "parent").mkdir()
    (tmp_path / "parent" / "Dockerfile").write_text(
        PARENT.replace("COPY ${LOCK_FILE} /parent.lock", "COPY does-not-exist /x")
    )
    (tmp_path / "parent" / "requirements.in").write_text("")
    (tmp_path / "parent" / "requirements.lock").write_text("")
    graph_text = TINY_GRAPH.split("  child:")[0]
    (tmp_path / "graph.yaml").write_text(graph_text)
    graph = tool.load_graph(tmp_path / "graph.yaml", tmp_path)
    plan = tool.make_plan(graph, version="9.9.9", git=tool.GitInfo(sha="f" * 40))
    with pytest.raises(tool.BuildFailed, match=r"build of parent failed .*COPY does-not-exist"):
        build(tool, plan, tmp_path, engine)


@pytest.mark.skipif(
    os.environ.get("RAYLIFT_FULL_IMAGE_BUILD") != "1",
    reason="the full build pulls CUDA images and GBs of wheels: set RAYLIFT_FULL_IMAGE_BUILD=1",
)
def test_full_graph_builds(tool, engine, graph) -> None:
    git = tool.git_info(REPO_ROOT)
    variant = os.environ.get("RAYLIFT_FULL_IMAGE_VARIANT") or None
    plan = tool.make_plan(graph, version="test", git=git, variant=variant)
    build(tool, plan, REPO_ROOT, engine)
    for image in plan.images:
        assert engine.exists(image.ref)
