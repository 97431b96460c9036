"""End-to-end samples on data that ships offline: `python -m samples.digits.run`, `python -m samples.intents.run`,
`python -m samples.nextword.run`, `python -m samples.assistant.run`."""


def print_round(line: str) -> None:
    """The federated runs' per-round lines (``round N: ...``), indented under the sample's steps."""
    if line.startswith("round "):
        print(f"   {line}", flush=True)
