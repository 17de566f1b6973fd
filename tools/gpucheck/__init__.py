"""gpu-check: every GPU path proved in one command (`make gpu-check`, `raylift gpu-check`,
`python -m tools.gpucheck`; docs/gpu-check.md).

One module per part, each importing only the ones listed before it, so no two import
each other:

- `cases`: the strategies, model sizes, each case's job and the planner's prediction;
- `probes`: a rank's peak memory over a block (CPU resident set, CUDA peaks);
- `bare`: the frameworks' own bare loops, the yardstick for tokens/s;
- `loss`: the loss kernels side by side (its own process on GPUs);
- `mfu`: the MFU case, Raylift's step at a Llama-3-8B shape;
- `calibrate`: the planner's device-level figures and the calibration file;
- `report`: verdicts, the table, the PNG and report.json;
- `worker`: what each torchrun rank runs (`python -m tools.gpucheck.worker PLAN`);
- `jobs`: assets, job folders, torchrun, and the result rows read back;
- `driver`: `main`, the one entry (`__main__` runs it).
"""
