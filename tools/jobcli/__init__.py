"""The job CLI (tools/submit.py, `raylift run|status|logs|stop|list|doctor`), one concern
per module:

    main      the verbs' parser, and the one place errors become a line and an exit status
    submit    `run`: validate, preflight, plan refusal, then upload and submit the config
    follow    following a job: its log, the progress bar, the summary, why it failed
    verbs     `status`, `logs`, `stop`, `list`: the runs already on the cluster
    doctor    `doctor`: one job checks every node; this side judges and shows the answer
    cluster   where the cluster is (--address, RAY_ADDRESS, the infra stack, local)
    client    the Jobs API client: its token, and a submit that waits out a starting head
    runs      runs and their submissions, as the Jobs API and the run's storage know them
    presets   `--size 7b|13b|70b`
    resubmit  `run --resubmit`: bring a lost run back
"""
