#!/usr/bin/env python
"""Fail the image build (or a node's bring-up check) when bitsandbytes cannot serve torch's CUDA.

"bitsandbytes not finding CUDA" is a classic late multi-node failure: the import succeeds on
a machine without a GPU and the missing kernel only shows at the first 8-bit optimizer step.
The build machine has no GPU, so instead of running a kernel this checks that the installed
package ships a native library built for the CUDA version torch was built with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    import bitsandbytes
    import torch

    cuda = torch.version.cuda
    if cuda is None:
        print(f"torch {torch.__version__} is a CPU build: bitsandbytes has no CUDA to use")
        return 1
    # BNB_CUDA_VERSION (e.g. 128) is bitsandbytes' own override for a source build made for
    # another CUDA than torch's; honour it the same way bitsandbytes does.
    tag = os.environ.get("BNB_CUDA_VERSION") or cuda.replace(".", "")[:3]
    package_dir = Path(bitsandbytes.__file__).parent
    libraries = sorted(p.name for p in package_dir.glob("libbitsandbytes_cuda*"))
    wanted = [name for name in libraries if name.startswith(f"libbitsandbytes_cuda{tag}")]
    if not wanted:
        print(
            f"bitsandbytes {bitsandbytes.__version__} has no library for CUDA {cuda} "
            f"(found: {', '.join(libraries) or 'none'}); rebuild with BNB_INSTALL=source"
        )
        return 1
    print(f"bitsandbytes {bitsandbytes.__version__}: {wanted[0]} for torch CUDA {cuda}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
