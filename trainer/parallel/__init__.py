"""Model parallelism composed with FSDP2 on one device mesh (dp, pp, tp).

- `layout`: the checks a (dp, pp, tp) layout needs from the model's config.json; pure
  Python, so the laptop's preflight runs them before any worker starts.
- `mesh`: the named device mesh and the ranks' coordinates in it.
- `tp`: tensor-parallel plans for Hugging Face decoder layers.
- `pipeline`: the stage builder (a whole HF model cut down to its stage's layers, HF
  parameter names kept) and the schedules of torch.distributed.pipelining.

The FSDP strategy (trainer.strategies.fsdp) is the only user: the loop never learns about
stages or meshes. Importing this package imports no torch; its modules but `layout` do.
"""
