"""The job CLI's entry: `python tools/submit.py run job.yaml ...`, the same as `raylift run
job.yaml ...`. The CLI itself is the package tools/jobcli, one concern per module (its
verbs and usage: tools/jobcli/main.py)."""

from tools.jobcli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
