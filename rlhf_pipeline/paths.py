"""The pipeline's paths, relative to the project's root: one home for each (dvc.yaml declares the same
ones; tests/test_dvc_yaml.py checks that every output named here is an output there).

Stage by stage, what each writes (its inputs are the outputs of the stages before it, plus the
folders at the bottom that hold a user's own files).
"""

from __future__ import annotations

BASE_MODEL = "models/base"  # base_model: the base model and tokenizer, with the pad token added
CORPUS = "data/corpus"  # corpus
QUERIES = "data/queries"  # queries
PREFERENCES = "data/preferences"  # preferences
VALIDATION = "data/validation"  # validate_preferences: the contract's results
VALIDATION_SUMMARY = f"{VALIDATION}/summary.json"
VALIDATION_DOCS = "data/validation_docs"  # validate_preferences: Great Expectations' Data Docs
REWARD_UNNORMALIZED = "models/reward_unnormalized"  # train_reward
REWARD = "models/reward"  # normalize_reward: the reward model the policy is trained against
POLICY = "models/policy"  # train_policy
POLICY_CHECKPOINTS = "checkpoints/policy"  # train_policy: resumable state (persist: true)
POLICY_LIVE = "dvclive/train_policy"  # train_policy: DVCLive's plots
EVALUATION = "evaluation"  # evaluate: responses, report pages

# each stage's metrics file
QUERIES_METRICS = "metrics/queries.json"
PREFERENCES_METRICS = "metrics/preferences.json"
REWARD_TRAIN_METRICS = "metrics/reward_train.json"
REWARD_METRICS = "metrics/reward.json"
POLICY_METRICS = "metrics/policy.json"
SPEED_METRICS = "metrics/speed.json"  # dvc.yaml's top-level metrics: git keeps it, dvc.lock records no hash of it
EVALUATION_METRICS = "metrics/evaluate.json"
EVALUATION_RESPONSES = f"{EVALUATION}/responses.jsonl"

# a user's own files, declared in dvc.yaml as dependencies of the stages that read them
LOCAL_MODELS = "data/models"  # a local base_model.source (or a reward model) lives here
RAW_DATA = "data/raw"  # a user corpus (data.corpus.source)
LABELS = "data/labels"  # user labels and prompt files (queries, preferences)

# the two lock files, which lock different things
DVC_LOCK = "dvc.lock"  # DVC's record of each stage's inputs and outputs (the audit trail)
# the retrain flow's copy of the last dvc.lock DVC could read, taken before each stage (DVC rewrites
# dvc.lock in place: a kill during that write leaves it truncated, and no dvc command reads it then)
DVC_LOCK_COPY = ".dvc/tmp/dvc.lock.last-good"
REQUIREMENTS_LOCK = "requirements.lock"  # every installed package at its exact version and hash (`make lock`)

# what a retrain run commits: a registry version is a commit, and these are what git keeps of a run
RUN_RECORD = (DVC_LOCK, "metrics", EVALUATION)
