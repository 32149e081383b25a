"""Training the embedded default model: its tokenizer, corpus, loss and optimiser loop."""
