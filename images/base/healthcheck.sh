#!/usr/bin/env bash
# HEALTHCHECK for Raylift images. A container started with `ray start` leaves Ray's session
# address in its temp dir ($RAY_TMPDIR/ray, /tmp/ray by default, as Ray itself does); there
# `ray health-check` asks the GCS whether the cluster answers. A container that runs
# `python -m trainer` (no Ray daemon) has nothing to probe and is healthy as long as it
# runs, so the check passes there rather than marking good jobs unhealthy.
set -euo pipefail

if [[ ! -e "${RAY_TMPDIR:-/tmp}/ray/ray_current_cluster" ]]; then
    exit 0
fi

exec ray health-check
