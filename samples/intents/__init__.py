"""The intents sample: MiniLM with LoRA on Home Assistant's voice commands, tested on unseen homes."""
