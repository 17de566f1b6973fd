"""Benchmark evaluation: lm-evaluation-harness tasks scored with the model as the
strategy holds it (DDP, FSDP2, ZeRO-3), in the loop (`train.eval_tasks`) and after a run.

The eval *loss* stays in trainer.observability.evaluation; this room holds what lm-eval
needs: an `LM` over the strategy's forward whose requests are split over ranks and
gathered back in request order (`sharded`), the task specs (`tasks`), and the loop's
component that decides when the tasks run (`component`).
"""
