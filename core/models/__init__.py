"""Our torch code for the MoE architectures WriteScope decodes: DeepSeek-V2 (MLA), Qwen3-MoE, Mixtral."""
