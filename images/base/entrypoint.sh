#!/usr/bin/env bash
# Entrypoint of every Raylift image (run under tini). One image serves two jobs:
#   ray start --head --block ...      a Ray node (what infra/'s node bootstrap runs)
#   run job.yaml | python -m trainer  the trainer without Ray (torchrun, Slurm, Kubernetes)
# Trainer subcommands are recognised so `docker run IMAGE run job.yaml` works; anything else
# is executed as given, so `ray ...`, `python ...` and `bash` behave as usual.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    exec ray --help
fi

case "$1" in
    run | plan | validate | --help | -h)
        exec python -m trainer "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
