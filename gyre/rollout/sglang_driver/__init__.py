"""The driver of a real SGLang server: its launch, its flags and the weight pushes it needs."""
