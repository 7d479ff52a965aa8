"""The phases as plain functions, and the doit tasks made from them."""
