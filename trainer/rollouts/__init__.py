"""Rollouts for the online RL objectives: the prompts of a step, completions sampled from
the policy as it is (the engine seam: `generate` on the training workers), their rewards
(trainer.rewards) and advantages, laid out as micro batches the objective's loss reads."""
