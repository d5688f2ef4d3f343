"""Managed vLLM workers: model preparation (``model_prep``), launch command (``launch``) and supervision
(``supervisor``). Nothing here imports torch or vLLM; workers and the GGUF conversion run in subprocesses.

Imports nothing from the rest of the gateway (the config models import its ``spec``).
"""
