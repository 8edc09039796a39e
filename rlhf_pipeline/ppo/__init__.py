"""PPO for the policy, one concern per module, from the maths up:

- :mod:`.kl`: the per-token KL penalty, the rewards it shapes, the coefficient's controllers;
- :mod:`.advantages`: the advantage estimators;
- :mod:`.losses`: the clipped policy and value losses;
- :mod:`.policy`: the trained module (policy LM + value head) and how it is saved;
- :mod:`.checkpoint`: resumable checkpoints and every random generator's state;
- :mod:`.stats`: what an update measures, typed, and the one place their metric names live;
- :mod:`.kl_budget`: ``ppo.kl.budget``'s state and decisions (read precisely, roll back);
- :mod:`.parts`: the trainer's collaborators in one typed container, and the factory that builds them;
- :mod:`.rollout`: the policy's episodes, sampled, scored and read against the reference;
- :mod:`.trainer`: the loop, rollout -> advantages -> loss -> step.

Only the train_policy and evaluate stages import this package, so editing any of it reruns those
two stages and nothing upstream.
"""
