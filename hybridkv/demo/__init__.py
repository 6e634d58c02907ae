"""The embedded demo model: the corpus it learns from (``corpus``), its training through the
serving model code (``train``), and the build into a cached checkpoint directory (``build``)."""
