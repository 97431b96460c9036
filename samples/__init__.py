"""End-to-end samples on data that ships offline: `python -m samples.digits.run`, `python -m samples.intents.run`."""
