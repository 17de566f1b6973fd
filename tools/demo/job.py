"""The demo's job: a tiny Llama fine-tuned for one epoch on a GSM8K-shaped dataset in the
Ray Llama template's format, two workers, checkpoints every 25 steps (the newest two
kept), evaluation every 25. `{assets}`, `{out}` and `{name}` are filled in per run."""

JOB = """\
model:
  path: {assets}/model
  special_tokens: {assets}/data/tokens.json
data:
  train_file: {assets}/data/train.jsonl
  eval_file: {assets}/data/eval.jsonl
  block_size: 64
train:
  micro_batch_size: 8
  epochs: 1
  eval_every: 25
  log_every: 1
optim:
  lr: 3.0e-3
  warmup_steps: 10
  weight_decay: 0.01
scaling:
  num_workers: 2
checkpoint:
  every_steps: 25
  keep_last: 2
storage:
  path: {out}/runs
run:
  name: {name}
  max_failures: 2
"""


def with_benchmark(job: str, task: str) -> str:
    """`job` with a local benchmark task (tools.demo.bench) in train.eval_tasks: scored
    before step 1 and after the last. Apart from JOB, which the image test reuses in an
    image that may not carry lm-eval."""
    return job.replace("train:\n", f"train:\n  eval_tasks: [{task}]\n", 1)
