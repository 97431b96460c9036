"""The digits sample: scikit-learn's bundled 8x8 digits, an MLP, on-device training and Flower rounds."""
