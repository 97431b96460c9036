"""ONNX Runtime on-device training runtime: no torch."""
