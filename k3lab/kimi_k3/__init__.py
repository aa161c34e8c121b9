"""Everything Kimi-K3: the config, llama.cpp's `kimi-k3` keys, the rule table, the transforms, the tokenizer, the reference forward."""
