"""The core: what an artifact is and how a graph runs, with no knowledge of checkpoints, recipes or serving.

The IR (`ir`: Graph, Node, ModelConfig), tensor formats and their schemes (`formats`), the op vocabulary
with its torch references (`ops`), the lazy tensor store (`store`), the executor (`execute`), the KV-cache
spec (`kv_cache`), rope tables (`rope`), the artifact contract (`artifact`: write and `read`), runtime
settings (`settings`) and the user-error line (`errors`). Everything else in optc imports from here;
nothing here imports the frontend, the commands or the runtime.
"""
