"""gdkv's demos and the model they serve, outside the installed package (run from a clone):

    PYTHONPATH=demo python -m gdkv_demo.vllm_demo   # a real vLLM engine serving through gdkvd
    PYTHONPATH=demo python -m gdkv_demo.reuse        # the same reuse with transformers alone
    gdkv_demo.model                                  # builds the random-weight Llama they serve
"""

import os
from pathlib import Path

# The folder that holds this package.
DEMO_DIR = str(Path(__file__).resolve().parent.parent)


def child_env(env=None) -> dict:
    """A copy of ``env`` (default: this process's) with this package's folder first on
    PYTHONPATH: the environment of a child process that imports gdkv_demo."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (DEMO_DIR, env.get("PYTHONPATH")) if p)
    return env
