"""Model families, the ops their layers compute with, weight loading and the
architecture registry."""
