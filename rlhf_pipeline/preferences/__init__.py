"""Preference labels: their formats (:mod:`.formats`), splits and label rounds (:mod:`.splits`), simulated
labels (:mod:`.simulated`) and the TRL export (:mod:`.export`); the data contract's text rules are at the
library's base (:mod:`rlhf_pipeline.text_rules`), since queries and conversations apply them too. Import from
the module that holds a name: importing this package loads none of them."""
