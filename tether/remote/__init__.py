"""The far-side package, shipped whole: stdlib only, Python >= 3.8 (builtin/ trainers add their own packages)."""
