"""The frontend: from a checkpoint and a recipe to an artifact.

Sources (`sources`: HF folders, GGUF, `package:`, `random:`), model families (`models`), the recipe and
its JSON schema (`recipe`, `schema`), calibration data (`calibration`), the quantizers the quantization
passes share (`quant`), the pass manager (`passmanager`; the passes live in optc.passes) and `build`,
which runs them and writes the artifact through optc.core.artifact.
"""
