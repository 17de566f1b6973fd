"""A Debian 12 OS image made from Debian's archive, for machines that cannot pull one.

The images' production OS is `debian:bookworm-slim` from Docker Hub. Where Docker Hub is out
of reach (CI behind a proxy, an air-gapped builder with a Debian mirror), mmdebstrap makes
the same distribution's minimal root filesystem from the archive, and podman imports it as a
local image; `build --os-image localhost/debian:bookworm-slim` then builds on it. The
tarball can be kept (`--cache`) so a second import costs seconds.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

from tools.imagetool.engine import run_text
from tools.imagetool.errors import UserError

log = logging.getLogger("raylift.image")
DEFAULT_OS_TAG = "localhost/debian:bookworm-slim"
SUITE = "bookworm"


def os_image_exists(tag: str) -> bool:
    probe = ["podman", "image", "exists", tag]
    return shutil.which("podman") is not None and subprocess.run(probe).returncode == 0


def make_os_image(tag: str = DEFAULT_OS_TAG, *, cache: Path | None = None,
                  mirror: str | None = None) -> str:  # fmt: skip
    """Make (or reuse) the local Debian 12 image `tag`; return its tag."""
    if os_image_exists(tag):
        log.info("%s exists: reusing it", tag)
        return tag
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("podman", "podman")):
        if shutil.which(tool) is None:
            raise UserError(f"`{tool}` is not installed: `apt-get install {package}` and retry")
    tarball = cache or Path("/var/tmp/raylift-images") / f"{SUITE}-minbase.tar"
    tarball.parent.mkdir(parents=True, exist_ok=True)
    if not tarball.is_file():
        started = time.monotonic()
        log.info("mmdebstrap: making a minimal Debian %s root filesystem (a few minutes)", SUITE)
        # mmdebstrap picks its output format from the file's extension (a name it does not
        # know makes a directory), so the format is explicit and the part keeps ".tar".
        tmp = tarball.with_name(tarball.stem + ".part.tar")
        cmd = ["mmdebstrap", "--variant=minbase", "--format=tar", "--quiet", SUITE, str(tmp)]
        run_text([*cmd, *([mirror] if mirror else [])], timeout=3600)
        tmp.replace(tarball)
        log.info("mmdebstrap took %.0f s", time.monotonic() - started)
    run_text(["podman", "import", str(tarball), tag], timeout=600)
    log.info("imported %s as %s", tarball, tag)
    return tag
