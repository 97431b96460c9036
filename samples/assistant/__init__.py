"""The assistant sample: SmolLM2 fine-tuned with LoRA on the device to turn spoken commands into actions."""
