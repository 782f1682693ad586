"""Template layers and images: the layer cache built with mmdebstrap (and the compatibility shim), user template builds and their layers, OCI archives, and the built-in template's image."""
