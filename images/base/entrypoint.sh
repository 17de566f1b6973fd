#!/usr/bin/env bash
# Entrypoint of every Raylift image (run under tini). One image serves two jobs:
#   ray start --head --block ...      a Ray node (what infra/'s node bootstrap runs)
#   run job.yaml | python -m trainer  the trainer without Ray (torchrun, Slurm, Kubernetes)
# Trainer subcommands are recognised so `docker run IMAGE run job.yaml` works; anything else
# is executed as given, so `ray ...`, `python ...` and `bash` behave as usual.
#
# A Ray worker node (`ray start` with RAYLIFT_ROLE=worker, from infra's /etc/raylift/node.env)
# also gets the spot-notice node agent (`python -m trainer agent`, trainer/resilience/agent.py) in the
# background: it polls the instance metadata service and drains this Ray node on a spot
# notice. RAYLIFT_AGENT=1 starts it on any `ray start`, RAYLIFT_AGENT=0 never. It is a child
# of this process, which becomes Ray, so it ends with the container.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    exec ray --help
fi

wants_agent() {
    [[ "$1" == ray && "${2:-}" == start ]] || return 1
    case "${RAYLIFT_AGENT:-auto}" in
        1) ;;
        0) return 1 ;;
        *) [[ "${RAYLIFT_ROLE:-}" == worker ]] || return 1 ;;
    esac
    # The base image has no trainer package (the trainer image, which nodes run, has).
    python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("trainer") is None)'
}

if wants_agent "$@"; then
    # Ray records the node's cloud instance id (GcsNodeInfo.instance_id); the agent finds
    # its own node by it, which stays exact where an IP is not (several nodes on one host).
    if [[ -n "${RAYLIFT_INSTANCE_ID:-}" ]]; then
        export RAY_CLOUD_INSTANCE_ID="${RAY_CLOUD_INSTANCE_ID:-$RAYLIFT_INSTANCE_ID}"
    fi
    python -m trainer agent \
        --imds-endpoint "${RAYLIFT_IMDS_ENDPOINT:-http://169.254.169.254}" \
        --interval "${RAYLIFT_AGENT_INTERVAL_S:-5}" \
        --margin "${RAYLIFT_AGENT_MARGIN_S:-15}" &
fi

case "$1" in
    run | plan | validate | --help | -h)
        exec python -m trainer "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
