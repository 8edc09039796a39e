"""The reward model, one concern per module, from the model up:

- :mod:`.model`: :class:`~.model.RewardModel`, a scalar head on a backbone, and how it scores (text,
  one response, best-of-N rows packed into one sequence);
- :mod:`.persistence`: the folder it is saved in and loaded from, and the stock Hugging Face
  sequence classifier it exports;
- :mod:`.adoption`: building one on the base model's backbone, or adopting an existing classifier;
- :mod:`.normalization`: the gain and bias fitted on base-model samples, and the task's score;
- :mod:`.training`: the best-of-N loss and the training loop, the only module that needs the
  optimizer and :mod:`rlhf_pipeline.distributed`.

normalize_reward, train_policy and evaluate import the model, its files and its normalisation, not
its training; tests/test_dvc_yaml.py pins which stages read each module.
"""
