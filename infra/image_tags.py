"""Which image tags the nodes run: one source of truth shared with `tools/image.py push`.

The image tool tags every image `<name>-<version>-<git sha7>` (images/graph.yaml names the
trainer images `trainer-gpu` and `trainer-cpu`, built from the same commit) and `push` writes
the exact trainer-gpu tag it pushed to `build/image-tag`. The stack reads that file unless
`raylift:image.tag` names a tag, and derives the CPU tag by swapping the variant, so a stack can
never ask for a tag the tool does not produce. Pure (no Pulumi): the ECR lookup that proves the
tag was pushed lives in program.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from infra.settings import ImageSettings, SettingsError

INFRA_DIR = Path(__file__).resolve().parent
GPU_PREFIX = "trainer-gpu-"
CPU_PREFIX = "trainer-cpu-"
# Docker's tag grammar (the same rule tools/image.py applies when it makes a tag).
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ImageTags:
    gpu: str
    cpu: str | None  # None: not derivable (a hand-named tag without cpuTag)
    source: str  # where the GPU tag came from, for messages


def cpu_tag_for(gpu_tag: str) -> str | None:
    """`trainer-gpu-0.1.0-1a2b3c4` -> `trainer-cpu-0.1.0-1a2b3c4` (same version and commit)."""
    if gpu_tag.startswith(GPU_PREFIX):
        return CPU_PREFIX + gpu_tag[len(GPU_PREFIX) :]
    return None


def resolve_tags(image: ImageSettings, base_dir: Path = INFRA_DIR) -> ImageTags | None:
    """The tags from the stack config or the tag file; None when neither names one."""
    if image.tag is not None:
        gpu, source = image.tag, "raylift:image.tag"
    else:
        path = Path(image.tag_file)
        path = path if path.is_absolute() else (base_dir / path).resolve()
        if not path.is_file():
            return None
        gpu = path.read_text(encoding="utf-8").strip()
        source = str(path)
        if not _TAG_RE.match(gpu) or gpu.endswith("-latest"):
            raise SettingsError(
                f"raylift:image.tagFile: {path} holds {gpu[:80]!r}, not an exact image tag; "
                "run `make push` again or set raylift:image.tag"
            )
    return ImageTags(gpu=gpu, cpu=image.cpu_tag or cpu_tag_for(gpu), source=source)
