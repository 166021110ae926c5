"""Run as a script in the vLLM venv: vLLM's own log-probabilities of a prompt's tokens.

    python tests/engines/vllm_prompt_logprobs.py MODEL_DIR '[ids...]'

prints one line ``LOGPROBS [null, lp_1, ...]``: for each prompt position p >= 1, vLLM's
log-probability of token p given tokens [0, p) -- its own model, its own kernels, with no
muser connector in the way (tests/engines/test_vllm_families.py compares them with transformers').
One in-process vLLM on this machine's CPU, muser's default options (eager, in process).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from muser_cli.engines.vllm.options import default_options, split_options

    path, ids = sys.argv[1], json.loads(sys.argv[2])
    kwargs, env = split_options(default_options(on_cpu=True))
    os.environ.update(env)
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=256, **kwargs)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    got = [None] + [float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], ids[1:])]
    print("LOGPROBS " + json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
