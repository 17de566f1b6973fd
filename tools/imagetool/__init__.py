"""Raylift's image tool as a package of single-concern modules (tools/image.py is its CLI).

    errors     what the user sees as one line (and what is worth a retry)
    graph      images/graph.yaml, typed and validated: the only reader of that file
    buildplan  order, tags and build args: a pure function of the graph, commit and version
    build      `docker build` (BuildKit) per image, with progress and the failing step on error
    push       ECR login (boto3), pushes through the Docker SDK with retries, tag file
    locks      lock files: exact pins, resolved for the images' platform by `uv pip compile`
    cli        argparse verbs over the above

The names below are the package's API, re-exported so callers (tools/image.py, the tests)
need not know which module holds what.
"""

from tools.imagetool.build import (
    build_command,
    build_image,
    docker_client,
    ensure_buildx,
    run_build,
    subprocess_lines,
)
from tools.imagetool.buildplan import (
    GitInfo,
    ImageBuild,
    Plan,
    format_plan,
    git_info,
    image_ref,
    make_plan,
    normalize_registry,
    project_version,
)
from tools.imagetool.errors import (
    BuildFailed,
    EngineUnavailable,
    PushFailed,
    TransientError,
    UserError,
)
from tools.imagetool.graph import (
    DEFAULT_GRAPH,
    REPO_ROOT,
    Graph,
    ImageSpec,
    LockCheck,
    SdistCheck,
    build_order,
    chain,
    dockerfile_args,
    load_graph,
    validate_graph,
)
from tools.imagetool.locks import (
    LockReport,
    Pin,
    Resolution,
    canonical,
    chain_pins,
    check_locks,
    read_pins,
    resolvable,
    resolve,
    sdist_requires,
    write_locks,
)
from tools.imagetool.push import (
    RegistryCredentials,
    decode_authorization_token,
    ecr_credentials,
    is_transient,
    make_ecr_client,
    push_once,
    push_plan,
    registry_from_repositories,
    registry_login,
    resolve_registry,
    run_push,
    with_retries,
    write_tag_file,
)

__all__ = [
    "DEFAULT_GRAPH",
    "REPO_ROOT",
    "BuildFailed",
    "EngineUnavailable",
    "GitInfo",
    "Graph",
    "ImageBuild",
    "ImageSpec",
    "LockCheck",
    "LockReport",
    "Pin",
    "Plan",
    "PushFailed",
    "RegistryCredentials",
    "Resolution",
    "SdistCheck",
    "TransientError",
    "UserError",
    "build_command",
    "build_image",
    "build_order",
    "canonical",
    "chain",
    "chain_pins",
    "check_locks",
    "decode_authorization_token",
    "docker_client",
    "dockerfile_args",
    "ecr_credentials",
    "ensure_buildx",
    "format_plan",
    "git_info",
    "image_ref",
    "is_transient",
    "load_graph",
    "make_ecr_client",
    "make_plan",
    "normalize_registry",
    "project_version",
    "push_once",
    "push_plan",
    "read_pins",
    "registry_from_repositories",
    "registry_login",
    "resolvable",
    "resolve",
    "resolve_registry",
    "run_build",
    "run_push",
    "sdist_requires",
    "subprocess_lines",
    "validate_graph",
    "with_retries",
    "write_locks",
    "write_tag_file",
]
