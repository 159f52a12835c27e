"""The model registry, above the engine it manages: several models behind one server, loaded on demand, one SSD budget shared."""
