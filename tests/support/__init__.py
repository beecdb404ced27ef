"""What the tests share: tiny case files (`cases`), test doubles named as such (`doubles`, `fake_rank_runner`,
`fault_runners`, `fault_storage`), checks the end-to-end tests make on real runs (`e2e`), the DeepSeek-V3 case
builder (`deepseek_v3_builder`) and its HF transformers reference (`hf_reference`). Test modules import from here,
never from each other."""
