"""The next-word sample: an LSTM language model over the intents commands, trained per home."""
