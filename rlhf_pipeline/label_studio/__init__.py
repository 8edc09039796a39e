"""Label Studio, where people label: the labelling interface and what a task carries (:mod:`.interface`),
best-of-N tasks sampled from a model (:mod:`.tasks`), the HTTP client of a running server (:mod:`.client`),
its JSON export read into preference rows (:mod:`.export`), and the import the ``rlhf label import`` command
and the retrain flow's pull run (:mod:`.importing`). Import from the module that holds a name: importing this
package loads none of them (:mod:`.tasks` loads torch and transformers, which reading an export does not need)."""
