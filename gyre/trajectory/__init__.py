"""Request records, trajectory trees, provenance masks, admission sampling, materialisation, storage."""
