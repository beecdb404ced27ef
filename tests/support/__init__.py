"""What the tests share: tiny case files (`cases`), test doubles named as such (`doubles`, `fake_rank_runner`, `fault_runners`, `fault_storage`),
checks the end-to-end tests make on real runs (`e2e`), DeepSeek-V3 configs, HF-named checkpoints and causal_lm
requests (`deepseek_v3`) and HF transformers' side of a causal_lm run as a script (`hf_deepseek_reference`). Test
modules import from here, never from each other."""
