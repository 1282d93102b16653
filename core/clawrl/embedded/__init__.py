"""The embedded default model: tokenizer and chat template, synthetic corpus, build, evaluation."""
