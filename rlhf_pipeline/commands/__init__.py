"""The `rlhf` command's subcommands, one module per group as DVC's ``dvc/commands/`` are: each holds its
commands and adds their parsers; :mod:`rlhf_pipeline.cli` assembles them and runs one."""
