"""What is copied to the far side: stdlib only, Python >= 3.8."""
